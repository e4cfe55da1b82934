"""`flashcore bench` with phase 14's D = 64 build on phase 09 at another count of consumer warpgroups
than HOPPER_CONSUMERS's (warm.py's FLEX_CONSUMERS; its kernels in a cache folder of their own, since
the cache's key does not hold the count). From the repository root, on a GPU:

    FLEX_CONSUMERS=3 FLASHCORE_CACHE_DIR=/tmp/fc3 python3 docs/tuning/14_builds/warm.py 3 64,float16,-,causal
    FLEX_CONSUMERS=3 FLASHCORE_CACHE_DIR=/tmp/fc3 python3 docs/tuning/14_builds/consumers.py --flex ... --out X.json
"""
import sys

from warm import consumers_at_64

if __name__ == "__main__":
    consumers_at_64()
    from flashcore_numba.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
