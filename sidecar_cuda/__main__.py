import sys

from broker.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
