"""Writes p10v10.py: make_variant9.py's prefetch two tiles past the newest cp.async."""
from make_variant7 import HEADER, write
from make_variant9 import prefetch_edits

if __name__ == "__main__":
    write("p10v10", HEADER + prefetch_edits(2))
