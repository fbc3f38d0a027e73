"""The in-worker half of precision debugging: hooks that dump every API call's inputs and
outputs in msprobe's format, and the seeding that makes two runs comparable."""
