from curvalign.cli import main

main()
