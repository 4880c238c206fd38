"""Triton kernels for the model's hot paths, one fused op per file beside its torch reference.

`quant.py` (FP8 / FP4-E4M3 / MXFP4 fake quant and quantise+pack, bit-exact), `mhc.py` (fused
Single-Pass mHC boundary, forward and backward), `sparse_attn.py` (gathered-index CSA attention with
sink, forward and backward), `moe.py` (grouped routed-expert GEMMs with the clamped SwiGLU fused,
forward and backward), `indexer.py` (lightning-indexer scores without the [B,S,I,G] buffer, forward
and backward, block maxima, restricted scores of candidate blocks); `launch.py` holds the launch rules
they share (interpreter, fp32 dot precision, launch options, SM count). Nothing is imported here, so
`import kernels` stays free of Triton.
"""
