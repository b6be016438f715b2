"""Autograd functions, torch.library custom ops and functional entry points, one file
per op family, each above the kernels it launches (``tkern/kernels``):

``linear.py``    ``tkern.linear`` / ``tkern.matmul``: the GEMM with fused epilogues, forward and
                 backward (custom ops ``tkern::linear_forward``, ``tkern::mm_backward``,
                 ``tkern::activation_grad``)
``mlp.py``       ``linear_act_linear``: two linears with an activation between them as one autograd
                 function, the activation's gradient in the second layer's dgrad epilogue (GPT-2's
                 MLP, converted by ``nn.fusion``; eager only: traced calls run two ``linear`` calls);
                 ``linear_glu_linear``: a gated MLP (Llama's, Phi-3's packed one) the same way,
                 the gated unit's backward in down's dgrad epilogue (``gemm.matmul_grad_glu``)
``projections.py``  ``shared_input_linears``: linears that read one input (an attention's q, k, v)
                 as one autograd function, their input gradients summed by the dgrad GEMMs (eager
                 only: traced calls run separate ``linear`` calls)
``float8.py``    ``float8_linear`` (custom ops ``tkern::float8_cast_2d``,
                 ``tkern::float8_cast_blocks``, ``tkern::roll_amax_history``, ``tkern::scaled_mm``:
                 with an optional activation in its epilogue, an MLP's forward)
``float8_emit.py``  ``float8_linear``'s ``emit_fp8``: the forward GEMM's epilogue writing the next
                 fp8 layer's input cast (eager only)
``float8_args.py``  what ``float8_linear`` checks of its fp8 arguments, and ``Float8Input`` (an
                 input cast by its producer, ``norm.norm_float8``)
``float8_cache.py``  the fp8 weight cache a fused optimizer writes once per step
                 (``Float8WeightCache``, ``float8_weight_cache``; re-exported by ``float8.py``)
``cross_entropy.py``  ``tkern.cross_entropy`` (custom ops ``tkern::cross_entropy_rows``,
                 ``tkern::cross_entropy_backward``) and ``tkern.linear_cross_entropy`` (chunked
                 GEMMs + the fused kernel; the logits never materialized; custom ops
                 ``tkern::linear_cross_entropy``, ``tkern::linear_cross_entropy_backward``)
``loss_chunks.py``  the chunked pass of ``linear_cross_entropy`` (per chunk: logits GEMM, kernel,
                 dgrad, fp32 wgrad), which both its doors run
``norm.py``      ``tkern.layer_norm``, ``tkern.rms_norm``, ``tkern.add_layer_norm``,
                 ``tkern.add_rms_norm``: LayerNorm / RMSNorm with fp32 statistics, forward and
                 backward (custom ops ``tkern::norm_forward``, ``tkern::norm_backward``);
                 ``norm_float8``: the forward that also casts its output to e4m3 for the next GEMM
``swiglu.py``    ``tkern.swiglu``, ``swiglu_packed``: a GLU MLP's ``act(gate) * up``, forward and
                 backward in one kernel each (custom ops ``tkern::swiglu``, ``tkern::swiglu_backward``)
``rotary.py``    ``tkern.apply_rotary_pos_emb``: HF's rotary embedding (partial rotary too), q and k
                 in one kernel forward and backward (custom op ``tkern::rotary``)
``common.py``    what the linear-like ops share: shapes, and the seam that puts dW into a fused
                 optimizer's flat gradient buffer
"""

# The entry points are imported from their files (``tkern.ops.linear.linear``); re-exporting
# ``linear`` here would shadow the submodule ``tkern.ops.linear``. tkern/__init__.py has them all.
