"""Tests of the lab (``echo_native.lab``): its command line and the echo demo.

A package so that ``tests/lab/test_cli.py`` and ``tests/test_cli.py`` can share a basename.
"""
