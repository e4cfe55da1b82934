"""Writes p10v13.py: make_variant12.py's prefetch of Q's rows and the first three tiles (the third
is the loop's first copy)."""
from make_variant7 import HEADER, write
from make_variant12 import first_tiles_edits

if __name__ == "__main__":
    write("p10v13", HEADER + first_tiles_edits(3))
