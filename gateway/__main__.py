import sys

from bulletin.cli import main

main(["gateway", *sys.argv[1:]])
