"""Op families. Each keeps a torch reference path (CPU), a Triton path (GPU) and a native
path behind one dispatch point, and registers its implementations in the op registry (`megatron_iso.registry`)."""
