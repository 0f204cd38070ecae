"""``python -m spore``: the spore command line."""

from spore.cli import main

main()
