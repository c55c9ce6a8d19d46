from bulletin import main

main()
