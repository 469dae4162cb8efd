from qinfer.cli import main

main()
