"""Shared pytest setup: put ``tests/`` on sys.path so test modules can ``from dist import run_ranks``."""

import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from s3_server import s3_server, s3_url  # noqa: E402,F401  (fixtures for every test folder)
