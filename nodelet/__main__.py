import sys

from bulletin.cli import main

main(["nodelet", *sys.argv[1:]])
