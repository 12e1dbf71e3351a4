"""The `encoderstack` subcommands that have a module of their own (cli.py registers them all): everything that
parses arguments lives in cli.py and here, so that the library modules never do."""
