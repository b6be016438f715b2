"""Triton kernels and their launchers. Nothing here knows about nn or optim.

Each family lives in one file (the GEMM family in four, each kernel with its
launcher, the shared epilogue and the config tables apart): private
``@triton.jit`` kernels (their docstrings and argument comments give each
pointer's shape and dtype) and the launchers that validate their arguments,
allocate and launch. The map, from kernel to
what a user touches, its tests and its benchmark:

gemm.py, gemm_tma.py, gemm_split.py (their shared rooms: gemm_epilogue.py, gemm_configs.py, gemm_plan.py)
    kernels: ``gemm._matmul_kernel`` (pointer; fp16/bf16, or fp8 operands with
    their scales applied to the fp32 accumulator), ``gemm_tma._matmul_tma_kernel``
    (persistent, TMA); both end in ``gemm_epilogue.epilogue`` (bias, activation,
    pre-activation, one cast) and walk tiles in ``gemm_epilogue.tile_coords``
    order. Launchers: ``gemm.matmul`` / ``matmul_prechecked`` / ``linear_prechecked``
    (scheduled by ``gemm_plan.plan_gemm`` from the tile count and waves: ragged operands and
    4 waves or more go to ``gemm_tma.launch_tma`` on Hopper, few tiles over a long K to
    ``gemm_split.launch_split_k``), ``gemm.matmul_backward`` /
    ``matmul_backward_prechecked`` (the pointer kernel's operand prologue: an
    activation's gradient applied to A, A' and its row sums stored), ``gemm.matmul_grad_act`` /
    ``matmul_grad_act_prechecked`` (the epilogue's ``GRAD_ACT``: ``(A @ B) * act'(Z)``, the dgrad
    of an MLP's second layer writing the first's dZ; pointer or TMA kernel), ``gemm.matmul_grad_glu`` /
    ``matmul_grad_glu_prechecked`` (``GRAD_GLU``: a gated unit's ``[d(gate) | d(up)]`` from the
    dgrad of the layer after it), ``gemm.matmul_tma_persistent``,
    ``gemm.scaled_mm``. Configs: ``gemm_configs.gemm_configs`` /
    ``tma_configs``, pruned per device and operands by ``prune_configs``.
    Above: ``ops.linear.linear`` (``_Linear``; custom ops ``tkern::linear_forward``,
    ``tkern::mm_backward``), ``ops.mlp.linear_act_linear`` / ``linear_glu_linear``,
    ``ops.float8.float8_linear``
    (``tkern::scaled_mm``), ``nn.Linear``, ``nn.Conv1D``, ``nn.Float8Linear``, ``tkern.matmul``,
    ``tkern.scaled_mm``. Tests: test_gemm.py, test_functional.py, test_float8.py,
    test_dgrad_epilogue.py, test_compiled.py (every offered config compiled, no spills),
    test_compiled_dact.py. Benchmarks:
    bench_gemm.py, bench_host.py, static_report.py.
gemm_blockwise.py
    kernel: ``_scaled_mm_blockwise_kernel`` (fp8 with 1x128 / 128x128 / 128x1 block scales,
    one K step per scale block, persistent, TMA). Launchers: ``scaled_mm_blockwise``,
    ``launch_blockwise`` (``gemm.scaled_mm`` routes its block-scaled calls there where
    ``blockwise_eligible``). Configs: ``gemm_configs.blockwise_configs``. Above:
    ``ops.float8.float8_linear`` (the "blockwise" recipe). Tests: test_gemm_blockwise.py,
    test_compiled.py. Benchmarks: bench_gemm.py (fp8 blockwise rows), static_report.py.
float8.py
    kernels: ``_amax_partials_kernel``, ``_cast_tensorwise_kernel``,
    ``_roll_history_kernel``, ``_cast_blocks_kernel`` (jit helpers
    ``amax_to_multiplier``, ``to_fp8_saturated``). Launchers: ``to_float8``,
    ``to_float8_delayed``, ``to_float8_delayed_deferred``, ``roll_amax_history``.
    Above: ``tkern.to_float8``, ``nn.Float8Linear`` (custom ops ``tkern::to_float8``,
    ``tkern::to_float8_delayed``, ``tkern::roll_amax_history``),
    ``ops.float8.Float8WeightCache`` (refreshed by the fused optimizers' step). Tests:
    test_float8.py, test_float8_linear.py, test_float8_weight_cast.py. Benchmarks: bench_gemm.py
    (fp8 scaled_mm rows: its casts and GEMM against torch._scaled_mm), bench_train.py (the fp8
    recipes).
activation.py
    kernel: ``_activation_grad_kernel``. Launcher: ``activation_grad``. Above:
    ``ops.linear.linear``'s backward (``tkern::activation_grad``). Tests:
    test_activation.py, test_functional.py. Benchmark: bench_gemm.py (fused GELU).
swiglu.py
    kernels: ``_swiglu_fwd_kernel`` (``h = act(gate) * up``), ``_swiglu_bwd_kernel`` (dgate,
    dup), fp32 inside with activation.py's jit helpers; 2-D with row strides (the halves of
    one packed tensor read in place). Launchers: ``swiglu_forward``, ``swiglu_backward``.
    Above: ``ops.swiglu.swiglu`` / ``swiglu_packed`` (custom ops ``tkern::swiglu``,
    ``tkern::swiglu_backward``), ``tkern.swiglu``, ``nn.fusion.FusedMLPForward`` (Llama-family
    MLPs in ``convert_network``). Tests: test_swiglu.py, test_blocks.py, test_compiled.py.
rotary.py
    kernel: ``_rotary_kernel`` (HF's ``rotate_half`` rotary embedding of q and k in one launch,
    the columns past ``cos.shape[-1]`` passed through; ``INVERSE``: its backward, by -theta),
    fp32 inside, any strides. Launcher: ``rotary_embedding``. Above: ``ops.rotary.apply_rotary_pos_emb``
    (custom op ``tkern::rotary``), ``tkern.apply_rotary_pos_emb``, ``nn.rotary.RotaryAttentionForward``
    (transformers' attention modules by family in ``convert_network``: ``nn.rotary.ROTARY_RULES``).
    Tests: test_rotary.py, test_hf_compile.py.
norm.py
    kernels: ``_norm_fwd_kernel`` (LayerNorm / RMSNorm of a row per program, fp32
    statistics, optional fused residual ``h = x + residual``), ``_norm_bwd_kernel``
    (dx, and dweight / dbias as fp32 partial sums per program), ``_norm_param_grads_kernel``
    (both reduced over the programs in one launch, written or added into a fused
    optimizer's flat gradient views). Launchers:
    ``norm_forward``, ``norm_backward`` (rows up to ``MAX_BLOCK`` in one block, longer
    ones in chunks). Above: ``ops.norm.layer_norm`` / ``rms_norm`` / ``add_layer_norm`` /
    ``add_rms_norm`` (``_Norm``; custom ops ``tkern::norm_forward``,
    ``tkern::norm_backward``), ``nn.LayerNorm``, ``nn.RMSNorm`` (and ``convert_network``'s
    norm rule), ``nn.residual.FusedDecoderForward`` (Llama-family decoder layers' and GPT-2
    blocks' first residual add, in ``convert_network``: ``nn.residual.DECODER_RULES``).
    Tests: test_norm.py, test_compiled.py, test_residual.py, test_rotary.py (the whole
    Llama). Benchmark: bench_norm.py.
    ``_norm_fwd_fp8_kernel`` (launcher ``norm_forward_float8``): the forward that also
    writes y's per-tensor e4m3 cast (y and y^T) for the next GEMM, with float8.py's jit
    helpers (delayed: the amax histories rolled in the launch; tensorwise: y's amax, then
    one ``cast_2d``). Above: ``ops.norm.norm_float8``, ``nn.float8_norm`` (convert_network's
    norm -> fp8 layer rules). Tests: test_float8_producers.py, test_compiled.py.
overflow.py
    kernels: ``_grad_stats_kernel``, ``_finalize_stats_kernel``. Launchers:
    ``grad_stats``; ``combine_stats`` combines the ranks' statistics. Above:
    ``optim.FusedOptimizer.step`` (pass 1), the ``amp`` scalers. Tests:
    test_overflow.py, test_optim.py, test_distributed.py. Benchmark: bench_optimizer.py.
adam.py, sgd.py (their shared lines in _update.py)
    kernels: ``_adam_kernel``, ``_sgd_kernel``. Launchers: ``adam_update``,
    ``sgd_update``. Shared jit helpers (_update.py): ``tile``, ``load_grad``,
    ``load_master``/``store_master`` (fp32, split or no master: stochastic
    rounding), ``load_state``/``store_state`` (fp32, bf16 or 8-bit block-quantized
    state); ``_convert_state_kernel`` (``state_to_fp32``/``state_from_fp32``:
    checkpoints); ``step_prologue``/``step_epilogue`` (``one_pass=True``: the whole
    step of a small buffer in one program, pass 1 by ``overflow.one_pass_stats``; with a
    ``barrier``, grid-wide: up to one program per SM meeting at ``grid_sync.grid_barrier``);
    ``step_path`` (which of the paths a step takes).
    Above: ``optim.FusedAdam``/``FusedAdamW``/``FusedSGD`` and
    their ``Distributed`` versions (pass 2; ``master=``, ``state_dtype=``).
    Tests: test_optim_one_pass.py, test_update_kernels.py, test_optim.py, test_optim_memory.py,
    test_optim_graph.py, test_optim_contracts.py, test_distributed.py.
    Benchmarks: bench_optimizer.py, bench_distributed.py, bench_memory.py.
grid_sync.py
    jit helpers: ``grid_barrier`` (a self-resetting spin barrier of a launch's co-resident
    programs), ``last_to_finish`` (a ticket). Host: ``GridBarrier`` (its workspace),
    ``new_grid_barrier``, ``check_programs``, ``sm_count``. Above: the grid-wide one-pass
    step (adam.py, sgd.py; ``optim.FusedOptimizer.one_pass = "grid"``). Tests:
    test_optim_one_pass.py (one program), test_gpu_grid_step.py (a GPU's SM count).
scale.py
    kernel: ``_update_scale_kernel``. Launcher: ``update_scale``. Above:
    ``amp.DynamicLossScaler`` and kin. Tests: test_scale.py, test_amp*.py.
    Benchmark: bench_optimizer.py (scaler overhead).
cross_entropy.py
    kernel: ``_cross_entropy_kernel`` (online max and sum over vocabulary chunks in
    fp32; loss terms, lse and the gradient into a separate buffer in one launch).
    Launchers: ``cross_entropy_forward``, ``cross_entropy_backward``; ``check_targets``.
    Above: ``ops.cross_entropy.cross_entropy`` (custom ops ``tkern::cross_entropy_rows``,
    ``tkern::cross_entropy_backward``), ``ops.cross_entropy.linear_cross_entropy`` (with
    the GEMMs, chunked by ops/loss_chunks.py; custom op ``tkern::linear_cross_entropy``),
    ``nn.CrossEntropyLoss``, ``nn.LinearCrossEntropy``, ``convert_network(
    fused_loss=True)`` (nn/hf_loss.py). Tests: test_cross_entropy.py,
    test_linear_cross_entropy.py, test_hf_fused_loss.py, test_hf_compile.py, test_compiled.py. Benchmarks:
    bench_loss.py, static_report.py.

``_common.py`` holds what every family shares: the execution mode (Triton's
interpreter on a CPU, compiled on a GPU), input checks, and jit helpers whose
result must not depend on the mode (rounding, accurate expm1).
"""

from tkern.kernels._common import INTERPRET, mode

__all__ = ["INTERPRET", "mode"]
