"""Bulletin: the command line, the single-machine cluster (``bulletin up``) and the wire
types (``bulletin.wire``) shared by every component."""
