"""DistillSpec: losses, data mixing (Alg. A.2) and the sharded trainer."""
