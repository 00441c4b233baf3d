"""The controller: acts on the analyzer's recommendations through HAProxy, safely.

observe (HAProxy, the analyzer) -> plan (pure) -> guard -> act -> record, every cycle.
"""
