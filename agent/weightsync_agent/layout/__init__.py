"""Data contracts both sides of a transfer compute identically: manifests, buckets, checksums (pure)."""
