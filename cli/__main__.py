from baton.cli.main import main

main()
