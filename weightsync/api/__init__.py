"""The WeightSyncGroup API: models, CRD generation, names shared by operator and agents."""
