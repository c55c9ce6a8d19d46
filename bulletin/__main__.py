from bulletin.cli import main

main()
