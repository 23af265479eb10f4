"""A study before it runs: the spec and its checks, the ladder, matching, groups."""
