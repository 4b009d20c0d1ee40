"""The mutant catalogue: each seeded bug, the public failure class it stands for, and the tests that kill it.

A mutant is killed when EVERY node id in `killers` fails in its call phase with the mutant applied (and all
of them pass without it). `docs/mutants.md` is this table in prose; `tests/unit/test_mutants.py` checks both.
Node ids are relative to the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from tests.mutants import patches

__all__ = ["Mutant", "MUTANTS", "get"]

HF17 = "tests/unit/test_model.py::test_hf_parity_prefill[17]"  # transformers' DeepseekV4, fp32 logits, 17 tokens
FINAL_NORM = "tests/unit/test_final_norm.py::test_final_norm_passes_on_the_model"  # Test 2 (hard stop)
BF16 = "tests/unit/test_bf16_numerics.py::"  # the bf16 numerics invariants (issue 17)
BF16_BACKEND = "tests/unit/test_bf16_backend.py::"  # bf16 triton backend vs reference, per call (issue 22 item 4)


@dataclass(frozen=True)
class Mutant:
    """name: the `$DSV4_MUTANT` value; failure_class: the public bug it stands for; apply: the patch;
    killers: pytest node ids that must fail under the mutant."""

    name: str
    failure_class: str
    apply: Callable[[pytest.MonkeyPatch], None]
    killers: tuple[str, ...]

    @property
    def description(self) -> str:
        """First line of the patch's docstring."""
        return " ".join((self.apply.__doc__ or "").split())


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("hand_rolled_prompt", "wrong prompt format: generation path hand-rolls the chat prompt",
           patches.hand_rolled_prompt_in_generate,
           ("tests/unit/test_generate_gate.py::test_generate_feeds_the_official_prompt[thinking]",)),
    Mutant("final_norm_removed", "final RMSNorm missing (invisible to argmax + cosine checks)",
           patches.final_norm_removed, (FINAL_NORM, HF17)),
    Mutant("final_norm_no_rms", "final norm present but not normalising (invisible to argmax + cosine)",
           patches.final_norm_without_rms, (FINAL_NORM, HF17)),
    Mutant("final_norm_before_hc_head", "final norm applied to the streams before hc_head",
           patches.final_norm_before_hc_head, (FINAL_NORM, HF17)),
    Mutant("comb_untransposed", "mHC comb not transposed in hc_post",
           patches.comb_untransposed,
           ("tests/unit/test_mhc_kernels.py::test_post_ref_orientation_on_asymmetric_comb",)),
    Mutant("sinkhorn_row_last", "Sinkhorn normalisation ending on a row step",
           patches.sinkhorn_ends_on_row_step,
           ("tests/unit/test_mhc_kernels.py::test_sinkhorn_ends_on_column_step[3]",)),
    Mutant("rope_split_halves", "RoPE on split halves (rotate_half) instead of interleaved pairs",
           patches.rope_split_halves,
           ("tests/unit/test_rope_gate.py::test_apply_rope_rotates_interleaved_pairs[bshd]",)),
    Mutant("yarn_mscale", "YaRN mscale applied (DeepSeek-V3 attention scaling carried over)",
           patches.yarn_mscale_applied,
           ("tests/unit/test_rope_gate.py::test_every_module_uses_its_layer_types_frequencies",)),
    Mutant("rope_theta_per_layer", "wrong RoPE per layer type (compressed layers without their theta/YaRN)",
           patches.rope_theta_per_layer_type_ignored,
           ("tests/unit/test_rope_gate.py::test_inv_freq_per_layer_type",)),
    Mutant("window_129", "sliding window off by one (129 tokens)",
           patches.window_off_by_one, (HF17,)),
    Mutant("attention_sink_dropped", "attention sink dropped from the softmax",
           patches.attention_sink_dropped,
           ("tests/unit/test_attention_kernels.py::test_ref_matches_dense_float64[7-fp32]",)),
    Mutant("compressor_state_shared_across_requests", "compressor state leaks from one request into the next",
           patches.compressor_state_shared_across_requests,
           ("tests/unit/test_request_isolation.py::test_second_request_equals_fresh_model",)),
    Mutant("csa_overlap_state_lost", "compressor state lost across the prefill -> decode boundary",
           patches.csa_overlap_state_lost, ("tests/unit/test_model.py::test_prefill_equals_decode_short[5]",)),
    Mutant("entry_visible_early", "compressed entry visible one token early (causality leak)",
           patches.compressed_entry_one_token_early,
           ("tests/unit/test_model.py::test_prefill_equals_decode_short[1]",)),
    Mutant("decode_tie_rule", "tie-dependent indexer picks: decode breaks ties unlike prefill",
           patches.decode_ties_differ_from_prefill,
           ("tests/unit/test_model.py::test_prefill_equals_decode_with_exact_indexer_ties",)),
    Mutant("hash_routing_ignored", "hash-routed layers routed by score top-k", patches.hash_routing_ignored,
           (HF17,)),
    Mutant("swiglu_clamp_missing", "SwiGLU clamp (swiglu_limit) missing",
           patches.swiglu_clamp_missing,
           ("tests/unit/test_moe_gate.py::test_swiglu_clamp_engaged[routed]",
            "tests/unit/test_moe_gate.py::test_swiglu_clamp_engaged[shared]")),
    Mutant("ue8m0_raw_byte", "scale bytes read as values (ue8m0 byte 120 -> 120.0)",
           patches.ue8m0_read_as_byte, ("tests/unit/test_quant.py::test_e8m0_is_an_exponent_not_a_number",)),
    Mutant("fp4_nibbles_swapped", "FP4 nibble order swapped when unpacking",
           patches.fp4_nibbles_swapped, ("tests/unit/test_quant.py::test_fp4_dequant_hand_block_both_nibbles",)),
    # issue 17: bf16 numerics, fp32-compute linears, the template's tools=, the sampler, kernel-only terms
    Mutant("act_quant_skipped", "FP8 activation quantization skipped before the FP8/FP4 linears (bf16 mode)",
           patches.act_quant_skipped, (BF16 + "test_quantized_linears_consume_fp8_activations",)),
    Mutant("kv_fp8_skipped", "FP8 rounding of the KV nope channels skipped (bf16 mode)",
           patches.kv_fp8_skipped, (BF16 + "test_window_kv_nope_is_fp8_and_rope_is_not_rounded",)),
    Mutant("indexer_fp4_block_16", "indexer FP4 rounding in the wrong block size (16 channels instead of 32)",
           patches.indexer_fp4_block_16, (BF16 + "test_indexer_q_and_keys_are_fp4_in_32_channel_blocks",)),
    Mutant("indexer_weight_scale_after_scoring", "indexer weight scale applied after the bf16 rounding / scoring",
           patches.indexer_weight_scale_after_scoring,
           (BF16 + "test_indexer_weight_scale_applied_before_the_bf16_rounding",)),
    Mutant("router_logits_bf16", "router logits computed in bf16 instead of fp32",
           patches.router_logits_bf16, (BF16 + "test_router_computes_in_fp32",)),
    Mutant("fp32_linear_in_bf16", "compressor / head linears computed in bf16 instead of fp32",
           patches.fp32_linear_in_bf16, (BF16 + "test_compressor_and_head_compute_in_fp32",)),
    Mutant("fp32_linear_kernel_x_bf16", "fp32 linear kernel (bf16-held head / router / compressor) rounds x to bf16",
           patches.fp32_linear_kernel_x_bf16,
           ("tests/unit/test_fp32_linear.py::test_matches_reference_within_fp32_sum_bound[3-300-512]",
            "tests/unit/test_fast_paths.py::test_fp32_linears_read_the_bf16_weight[decode_gemv]")),
    Mutant("hf_tools_misplaced", "HF tools= placed elsewhere than a first system message by the template",
           patches.hf_tools_misplaced,
           ("tests/unit/test_tools_kwarg_gate.py::test_tools_kwarg_equals_encoder_with_documented_system_message"
            "[no_system-thinking]",)),
    Mutant("sampler_noise_multiplied", "temperature sampling draws from the wrong distribution",
           patches.sampler_noise_multiplied,
           ("tests/unit/test_sampler.py::test_sampled_distribution_matches_softmax[0.6]",)),
    Mutant("hc_eps_dropped_in_kernel", "a small constant term (hc_eps) dropped from a Triton kernel only",
           patches.hc_eps_dropped_in_kernel,
           ("tests/unit/test_kernel_edges.py::test_hc_pre_saturated[20-bf16-one_launch]",
            "tests/unit/test_kernel_edges.py::test_hc_head_edges[saturated-fp32-two_launch]")),
    Mutant("sink_dropped_in_kernel", "attention sink dropped from the Triton kernel only",
           patches.sink_dropped_in_kernel, ("tests/unit/test_kernel_edges.py::test_sparse_attn_edges[1-fp32]",)),
    Mutant("sink_dropped_in_decode_kernel", "attention sink dropped from the all-heads decode kernel only",
           patches.sink_dropped_in_decode_kernel,
           ("tests/unit/test_attention_kernels.py::test_all_heads_kernel_matches_ref[h8-fp32]",
            "tests/unit/test_attention_kernels.py::test_all_heads_kernel_matches_ref[h16-dv32-split3-fp32]")),
    # issue 21: survivors of a mutation sweep (the sweep and its results: docs/mutants.md)
    Mutant("rmsnorm_eps_outside_root", "norm eps misplaced (outside the square root)",
           patches.rmsnorm_eps_outside_root, ("tests/unit/test_model.py::test_hf_parity_in_the_eps_regime",)),
    Mutant("routing_weight_after_w2", "routing weight applied after w2 instead of before (bf16 mode)",
           patches.routing_weight_after_w2, (BF16 + "test_routing_weight_scales_the_w2_input",)),
    Mutant("compare_logits_rel_dropped", "final-norm check blind to the logit magnitude (rel L2 criterion dropped)",
           patches.compare_logits_rel_dropped,
           ("tests/unit/test_final_norm.py::test_each_criterion_of_compare_logits_fails_alone",)),
    Mutant("hc_head_rounded_per_stream", "an extra bf16 rounding inside an mHC reference (hc_head)",
           patches.hc_head_rounded_per_stream, ("tests/unit/test_mhc_kernels.py::test_bf16_outputs_rounded_once",)),
    Mutant("generate_ignores_temperature", "the generation path drops the sampling temperature (greedy always)",
           patches.generate_ignores_temperature,
           ("tests/unit/test_generate.py::test_generate_samples_at_the_requested_temperature",)),
    Mutant("row_parallel_partial_rounded", "tensor-parallel partial sums rounded to bf16 before the all-reduce",
           patches.row_parallel_partial_rounded,
           ("tests/unit/test_parallel.py::test_row_parallel_partials_are_summed_before_the_bf16_rounding",)),
    Mutant("mhc_lo_piece_dropped", "the bf16x3 mHC projection drops fn's lo bf16 piece (16-bit weights)",
           patches.mhc_lo_piece_dropped,
           ("tests/unit/test_kernel_edges.py::test_hc_lo_piece_decides[two_launch-hc_pre]",
            "tests/unit/test_kernel_edges.py::test_hc_lo_piece_decides[one_launch-hc_head]")),
    # issue 22: Test 2 decides or says it cannot
    Mutant("final_norm_power_check_dropped",
           "final-norm check without its power check: a tolerance that would pass a model with no norm says PASS",
           patches.final_norm_power_check_dropped,
           ("tests/unit/test_final_norm.py::test_huge_eps_is_inconclusive_never_pass[no_norm]",
            "tests/unit/test_final_norm.py::test_zero_head_is_inconclusive")),
    Mutant("final_norm_tie_unaware", "final-norm check fails a correct model on a bf16 argmax near-tie",
           patches.final_norm_tie_unaware,
           ("tests/unit/test_final_norm.py::test_near_tie_flip_is_counted_not_failed",)),
    # issue 22 item 4: fast paths, the graph step and launches that no CPU hard stop ran
    Mutant("fp8_gemv_k_block_scale_dropped", "FP8 decode GEMV kernel drops one K block's weight scale",
           patches.fp8_gemv_k_block_scale_dropped,
           ("tests/unit/test_gemm_moe_kernels.py::test_fp8_linear_decode[M5-split]",
            BF16_BACKEND + "test_twin_decode_across_compression_boundaries_matches_reference")),
    Mutant("wo_a_gemv_reads_group_0", "grouped wo_a decode kernel reads every group's input from group 0",
           patches.wo_a_gemv_reads_group_0,
           ("tests/unit/test_fast_paths.py::test_grouped_wo_a_matches_reference[decode_gemv]",
            "tests/unit/test_gemm_moe_kernels.py::test_fp8_grouped_gemv_variants[dot u2]")),
    Mutant("gemv_tuned_split_drops_k_blocks", "a tuned launch (selected only on the GPU) gives wrong results",
           patches.gemv_tuned_split_drops_k_blocks,
           ("tests/unit/test_gemm_moe_kernels.py::test_every_tuned_gemv_launch_matches_reference"
            "[linear-dot-bn128-u2-x2-w8]",)),
    Mutant("moe_tiles_nibbles_swapped", "FP4 nibble order swapped in the MoE tile kernel only (prefill path)",
           patches.moe_tiles_nibbles_swapped,
           ("tests/unit/test_gemm_moe_kernels.py::test_moe_experts[T40-clamped-tiles]",
            BF16_BACKEND + "test_prefill_and_first_twin_step_every_path_matches_reference")),
    Mutant("graph_rope_stale_position", "decode step (graph-captured) de-rotates its output by a stale position",
           patches.graph_rope_stale_position,
           (BF16_BACKEND + "test_reference_twin_equals_eager_decode_bitwise[bf16]",
            "tests/unit/test_graph_decode.py::test_static_step_equals_decode[reference-21-12]")),
    Mutant("rope_tail_token0_position", "multi-token RoPE kernel rotates every token by token 0's position",
           patches.rope_tail_token0_position,
           ("tests/unit/test_rope_kernel.py::test_multi_token_rope_with_heads_rotates_each_token_by_its_position",
            "tests/unit/test_rope_kernel.py::test_rope_tail_matches_apply_rope[False-4-bf16-bsD]")),
    Mutant("rope_tail_heads_as_tokens", "multi-token RoPE with heads: head index taken as the token index",
           patches.rope_tail_heads_as_tokens,
           ("tests/unit/test_rope_kernel.py::test_multi_token_rope_with_heads_rotates_each_token_by_its_position",
            "tests/unit/test_rope_kernel.py::test_rope_tail_matches_apply_rope[False-4-bf16-bshD-multi]")),
    Mutant("quant_sim_fp4_ties_away", "quantization simulation kernel rounds ties away from zero, not to even",
           patches.quant_sim_fp4_ties_away,
           ("tests/unit/test_quant_kernels.py::test_quant_sim_bitwise[e2m1-32-bf16]",)),
    Mutant("rms_norm_kernel_eps_dropped", "RMSNorm kernel drops eps (the reference keeps it)",
           patches.rms_norm_kernel_eps_dropped,
           ("tests/unit/test_norm_kernel.py::test_rms_norm_matches_reference[bf16-64]",)),
    Mutant("compress_pool_kernel_ape_next_slot", "compressor pooling kernel adds the next slot's positional bias",
           patches.compress_pool_kernel_ape_next_slot,
           ("tests/unit/test_compressor_kernel.py::test_compress_step_matches_reference[csa-plain]",
            BF16_BACKEND + "test_twin_decode_across_compression_boundaries_matches_reference")),
    # issue 24: appending tokens to a state
    Mutant("append_partial_window_dropped", "an appended call forgets the compressor's partial window",
           patches.append_partial_window_dropped,
           ("tests/unit/test_append.py::test_any_split_equals_one_prefill[inside-window]",
            "tests/unit/test_append.py::test_split_with_exact_indexer_ties_picks_the_same_entries")),
    Mutant("append_ring_slot_shifted", "an appended call reads the window before it from the wrong ring slot",
           patches.append_ring_slot_shifted,
           ("tests/unit/test_append.py::test_any_split_equals_one_prefill[ring-wrap]",)),
    Mutant("step_index_kernel_ring_slot_shifted", "the decode step's index kernel reads the window from the next ring slot",
           patches.step_index_kernel_ring_slot_shifted,
           ("tests/unit/test_attention_kernels.py::test_step_index_kernel_matches_reference[sliding-s1-0]",
            "tests/unit/test_attention_kernels.py::test_step_index_kernel_matches_reference[hca-s3-2]",
            "tests/unit/test_rope_kernel.py::test_qkv_finish_is_the_two_launches[pos-bs-bf16]")),
    Mutant("joint_weight_halves_swapped", "a joint projection weight filled crosswise",
           patches.joint_weight_halves_swapped,
           ("tests/unit/test_gemm_moe_kernels.py::test_joined_shared_expert_equals_the_two_linears",
            BF16_BACKEND + "test_twin_decode_across_compression_boundaries_matches_reference")),
    Mutant("kv_finish_window_not_floored", "a compressed entry rotated at the decode token's position",
           patches.kv_finish_window_not_floored,
           ("tests/unit/test_rope_kernel.py::test_kv_finish_equals_the_chain[csa-entry]",
            BF16_BACKEND + "test_twin_decode_across_compression_boundaries_matches_reference")),
    Mutant("kv_finish_ring_slot_shifted", "the decode token's KV written to the next ring slot",
           patches.kv_finish_ring_slot_shifted,
           ("tests/unit/test_rope_kernel.py::test_kv_finish_writes_the_ring_slot",
            BF16_BACKEND + "test_twin_decode_across_compression_boundaries_matches_reference")),
    Mutant("fp8_gemv_rows_act_scale_dropped", "the batch-1 FP8 GEMV drops each K block's activation scale",
           patches.fp8_gemv_rows_act_scale_dropped,
           ("tests/unit/test_gemm_moe_kernels.py::test_fp8_linear_one_row_variants[default]",
            BF16_BACKEND + "test_one_row_decode_every_path_matches_reference")),
    Mutant("moe_gemv_block_scale_misaligned", "the MoE decode kernels scale each group by the wrong act_quant block",
           patches.moe_gemv_block_scale_misaligned,
           ("tests/unit/test_gemm_moe_kernels.py::test_moe_gemv_quantizes_in_the_kernel_bitwise",
            "tests/unit/test_gemm_moe_kernels.py::test_moe_default_gemv_matches_reference[1]")),
    Mutant("hc_fused_norm_unweighted", "the site RMSNorm fused into the decode mHC launch drops its weight",
           patches.hc_fused_norm_unweighted,
           ("tests/unit/test_mhc_kernels.py::test_hc_pre_triton[T1-D64-norm]",
            "tests/unit/test_mhc_kernels.py::test_hc_post_pre_triton[T1-D96-norm-bf16]")),
    Mutant("swiglu_gemv_v_scale_row_of_u", "the one-launch shared-expert SwiGLU scales w3's rows by w1's blocks",
           patches.swiglu_gemv_v_scale_row_of_u,
           ("tests/unit/test_gemm_moe_kernels.py::test_fp8_gemv_swiglu_is_the_two_launches[default-no-limit]",
            BF16_BACKEND + "test_one_row_decode_every_path_matches_reference")),
    Mutant("moe_combine_shared_row0", "the MoE combine adds token 0's shared-expert output to every token",
           patches.moe_combine_shared_row0,
           ("tests/unit/test_gemm_moe_kernels.py::test_moe_experts_adds_the_shared_output[bf16-gemv]",
            "tests/unit/test_gemm_moe_kernels.py::test_moe_experts_adds_the_shared_output[fp32-tiles]")),
    Mutant("compress_pool_rows_at_width", "the compressor kernel reads row-strided projection halves as contiguous",
           patches.compress_pool_rows_at_width,
           ("tests/unit/test_compressor_kernel.py::test_compress_step_matches_reference[csa-joint]",
            BF16_BACKEND + "test_ragged_decode_every_path_matches_reference")),
    Mutant("qkv_finish_q_rope_dropped", "the one-launch q + KV finish leaves q unrotated",
           patches.qkv_finish_q_rope_dropped,
           ("tests/unit/test_rope_kernel.py::test_qkv_finish_is_the_two_launches[pos-bs-bf16]",
            BF16_BACKEND + "test_one_row_decode_every_path_matches_reference")),
    Mutant("attn_out_rope_forward", "the attention output's RoPE channels rotated forward in the fused epilogue",
           patches.attn_out_rope_forward,
           ("tests/unit/test_attention_kernels.py::test_sparse_attn_rope_is_attention_then_inverse_rope[heads-bf16]",
            BF16_BACKEND + "test_one_row_decode_every_path_matches_reference")),
    Mutant("multi_turn_prefix_unchecked", "a chat's next turn appended to a state whose ids the prompt rewrote",
           patches.multi_turn_prefix_unchecked,
           ("tests/unit/test_generate.py::test_multi_turn_continues_the_state_only_when_the_prompt_extends_it[thinking]",
            "tests/unit/test_generate.py::test_multi_turn_refuses_a_state_it_cannot_continue")),
    # issue 24: ragged batches
    Mutant("ragged_row0_position", "a ragged batch's decode step runs every row at row 0's position",
           patches.ragged_row0_position,
           ("tests/unit/test_ragged.py::test_ragged_rows_equal_each_conversation_alone",
            "tests/unit/test_ragged.py::test_continuous_batching_a_replaced_row_leaves_the_others_untouched",
            "tests/unit/test_generate_batch.py::test_generate_batch_equals_each_conversation_alone")),
    Mutant("ragged_commit_row0_boundary", "a ragged row's compressor entry committed at row 0's window boundary",
           patches.ragged_commit_row0_boundary,
           ("tests/unit/test_ragged.py::test_ragged_rows_equal_each_conversation_alone",
            "tests/unit/test_compressor_kernel.py::test_per_row_positions_equal_each_row_alone[ref-csa]")),
    Mutant("ragged_commit_kernel_row0_boundary", "the commit kernel reads row 0's position for every row",
           patches.ragged_commit_kernel_row0_boundary,
           ("tests/unit/test_compressor_kernel.py::test_per_row_positions_equal_each_row_alone[kernel-csa]",
            "tests/unit/test_ragged.py::test_triton_ragged_decode_equals_the_reference_alone",
            BF16_BACKEND + "test_ragged_decode_every_path_matches_reference")),
    Mutant("verify_step_compressor_one_position", "a verify step compresses every token at its first position",
           patches.verify_step_compressor_one_position,
           ("tests/unit/test_ragged.py::test_lockstep_verify_step_equals_append",
            "tests/unit/test_ragged.py::test_ragged_rows_equal_each_conversation_alone")),
    Mutant("verify_step_ring_written_first", "a verify step overwrites ring slots its earlier queries read",
           patches.verify_step_ring_written_first,
           ("tests/unit/test_ragged.py::test_lockstep_verify_step_equals_append",)),
    # issue 26: speculative decoding
    Mutant("rollback_keeps_a_rejected_token_window", "a rollback keeps one rejected draft in a compressor window",
           patches.rollback_keeps_a_rejected_token_window,
           ("tests/unit/test_speculative.py::test_speculative_greedy_equals_plain_greedy[adversary-2]",
            "tests/unit/test_speculative.py::test_rollback_of_a_ragged_batch_keeps_each_rows_prefix")),
    Mutant("draft_eos_accepted_unverified", "a drafted EOS accepted without verification",
           patches.draft_eos_accepted_unverified,
           ("tests/unit/test_speculative.py::test_speculative_greedy_equals_plain_greedy[eos_drafts-3]",)),
    Mutant("speculative_batch_reads_another_rows_logits", "a verify that reads another row's logits",
           patches.speculative_batch_reads_another_rows_logits,
           ("tests/unit/test_speculative.py::test_speculative_greedy_batch_equals_each_row_alone",
            "tests/unit/test_speculative.py::test_speculative_sample_batch_rows_equal_each_row_alone")),
    Mutant("batch_chat_row_not_loaded", "a batch row continuing a chat gets its position but not its buffers",
           patches.batch_chat_row_not_loaded,
           ("tests/unit/test_generate_batch.py::test_generate_batch_continues_chats_where_the_ids_extend_them",)),
    # issue 29: the triton backend's torch GEMMs at bucketed row counts
    Mutant("bucketed_gemm_rows_after_the_padding", "a padded GEMM returns the padding's rows for its first ones",
           patches.bucketed_gemm_rows_after_the_padding,
           ("tests/unit/test_gemm_buckets.py::test_triton_entries_above_64_rows_match_their_references[100]",)),
    # issue 25: batch-invariant mode
    Mutant("invariant_split_follows_m", "batch-invariant mode whose split-K count follows the batch size",
           patches.invariant_split_follows_m,
           ("tests/unit/test_batch_invariant.py::test_fp32_linear_rows_invariant[invariant]",)),
    # issue 27: the router after its logits in one launch
    Mutant("route_kernel_ties_reversed", "router kernel breaks top-k ties unlike the reference (higher index first)",
           patches.route_kernel_ties_reversed,
           ("tests/unit/test_router_kernel.py::test_route_tie_rule[sqrtsoftplus]",)),
]}


def get(name: str) -> Mutant:
    """The mutant called `name`. Raises KeyError listing the known names."""
    try:
        return MUTANTS[name]
    except KeyError:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}") from None
