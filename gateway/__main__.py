from gateway.command import main

main()
