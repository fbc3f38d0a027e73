"""The offline half of precision debugging: two dumps read, tensor-parallel shards and
pipeline stages merged, compared row by row in msprobe's tables, and the advisor's verdict."""
