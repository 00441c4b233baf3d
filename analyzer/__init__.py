"""The analyzer: telemetry windows in, a verdict per GPU (starved, overloaded, balanced) out."""
