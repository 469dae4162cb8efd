from qinfer.cli.commands import main

main()
