from mtmoe.cli import main

main()
