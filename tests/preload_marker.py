"""A module the fork-server tests preload: it records the process that imported it."""

import os

IMPORTED_BY = os.getpid()
