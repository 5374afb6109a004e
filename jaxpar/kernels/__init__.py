"""Fused kernels (course module 5), each beside the pure-jnp reference it is tested against.

flash_attention  FlashAttention-2's forward and backward as Pallas kernels (causal, GQA/MQA)
rms_norm         fused RMSNorm forward and backward (Pallas)
cross_entropy    the output head's cross-entropy chunked over the sequence: [B, S, V] fp32 never exists
costs            FLOPs of the kernels in a traced step (XLA counts a custom call as zero)
varying          how a Pallas call's outputs vary inside shard_map(check_vma=True) (as traced)

On GPU the Pallas kernels lower through Triton; on CPU they run with `interpret=True`.
"""
