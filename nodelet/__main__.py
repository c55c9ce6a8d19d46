from nodelet.command import main

main()
