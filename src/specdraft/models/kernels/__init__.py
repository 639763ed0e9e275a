"""Small C kernels for the CPU decode step, built once by the system C compiler.

A decode or verify step on a CPU runs ~1,000 small ops; eager PyTorch spends tens of
microseconds on each (dispatch, allocation, a thread-pool wake-up), which on a 2-core machine
is as much time as the weights take to read. These kernels do the step's pieces in one call
each: the fp16-weight matmul of --weights fp16 (fp16_gemv.c), the GGUF block matmul
(block_gemv.c), attention for a few queries over the cache (attention.c), RMSNorm and the pair
of norms between attention and MLP (rms_norm.c), q/k norms + RoPE + the KV cache write
(qk_rope.c), the gated MLP's activation (gated_act.c), the greedy head's int8 screen
(int8_screen.c) and the MTP drafter's candidate scores (score_rows.c); simd.h holds what they
share. With fp16 weights a decoder layer's short forward is one call (decoder_layer.c strings
the others together; kernels.h declares them); with other weights it is six C calls around the
projections (models/architectures/decoder.py). Each computes every row in one fixed order, so a row's result
never depends on the rows beside it (speculative output equals plain output).

`build.library()` compiles every .c file here into one shared library in the cache folder
(once per source, compiler and flags) and loads it with ctypes. On CPUs with AVX-512 (F, BW,
VL, DQ, VNNI) it builds with those too, and block_gemv.c and int8_screen.c take 16-lane and
VNNI loops (1.02-1.15x a step on a Zen 4 EPYC); SPECDRAFT_KERNEL_ISA=avx2 keeps the AVX2 build.
q8_act_gemv.c's AVX2 and VNNI loops give the same bits (tests/test_q8_act_linear.py).
"""
