from qinfer.cli.commands import main

main()  # `python -m qinfer.cli`, the same command line as `python -m qinfer` and the `qinfer` script
