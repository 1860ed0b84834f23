"""Test doubles of the serving stack: the mock engine (`mock_engine`)."""
