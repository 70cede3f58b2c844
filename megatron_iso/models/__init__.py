"""Models built by Megatron-Core from megatron_iso's ModuleSpecs (dense now; MoE and hybrid GDN next)."""
