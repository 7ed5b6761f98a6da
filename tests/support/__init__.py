"""What the tests share: the in-memory harnesses of the broker's API (``api``, ``v2``)
and of the client side (``client``), real broker processes (``processes``), and the
checks of a built distribution (``check_dist``)."""

from pathlib import Path

# The checkout the tests run in: docs, examples, conf/ and bench/ are read from it.
REPO = Path(__file__).resolve().parents[2]
