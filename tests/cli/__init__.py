"""specjax/cli/ (layer 7) and the project's contracts: the CLI, bad input, trees on the command line, the README's
test command, the layer table and the route of docs/ARCHITECTURE.md."""
