"""Exposition text per naming profile: ``profiles.render`` turns a published view into /metrics.

The package imports nothing itself, so that ``text`` (the format alone) stays cheap to import
for the lab's workers, which render serving stacks' formats with it and start on every move.
"""
