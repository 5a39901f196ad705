"""Test configuration: 8 CPU devices, strict dtype promotion, and shared helpers."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


class TraceCounter:
    """Counts how many times a function body is traced (run in Python)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


@pytest.fixture
def traces() -> TraceCounter:
    return TraceCounter()


# The slowest tests (by `pytest --durations`, on 2 cores) run in `make test-slow`, which CI runs
# after `make test`, so `make test` stays under about 6 minutes. Node-id prefixes; the docs'
# pages are doctests and cannot carry a decorator.
SLOW = (
    "docs/circuits.md::",
    "tests/test_induction.py::test_a_few_steps_lower_the_loss_and_the_cache_reloads_the_weights",
    "tests/test_induction.py::test_training_learns_induction_heads_that_read_the_previous_token_head",
    "docs/attention.md::",
    "docs/from_transformer_lens.md::",
    "docs/patching.md::",
    "docs/generation.md::",
    "docs/float32_layer.md::",
    "docs/harvest.md::",
    "docs/features.md::",
    "docs/learned_masks.md::",
    "docs/training.md::",
    "docs/nonfinite.md::",
    "tests/test_reliability_property.py::test_capture_equals_a_hand_unrolled_forward",
    "docs/sae.md::",
    "docs/param_noise.md::",
    "docs/gradients.md::",
    "docs/gradcam.md::",
    "tests/test_sae.py::test_cli_harvest_tokens",
    "tests/test_harvest_safety.py::test_cli_overwrite_of_user_folders_and_dot",
    "tests/test_ops.py::test_scanned_decoder_probabilities_edits_and_gradients",
    "tests/test_ops.py::test_gradients_of_operations_equal_finite_differences",
    "tests/test_transforms.py::test_no_tracer_leaks",
    "tests/test_reliability_property.py::test_no_op_hooks_interceptors_and_capture_change_no_bit",
    "tests/test_reliability_memory.py::",
    "tests/test_harvest_procs.py::",
    "tests/test_pickle.py::",
    # Every feature on a Llama written the jax-llm-examples way (about 100 s of CPU): make test
    # keeps tests/test_programs.py, the same features on a smaller program.
    "tests/models/test_model_jaxllm_like.py::",
    # Haiku's own behaviours and every feature on it (about 35 s; the conformance suite keeps
    # Haiku in make test), and the slower half of program summaries (FLOPs lowered per call
    # site, scans, abstract inputs, a CLI factory; rows and parameters stay in make test).
    "tests/test_haiku.py::",
    "tests/test_summary_functions.py::test_flops_match_the_whole_program_and_each_function_alone",
    "tests/test_summary_functions.py::test_scanned_layers_are_one_row_with_the_layer_count",
    "tests/test_summary_functions.py::test_abstract_weights_and_spec_inputs_give_the_same_summary",
    "tests/test_summary_functions.py::test_cli_summary_of_a_factory_returning_a_program",
    # By --durations of the whole suite (2 workers), every test over ~1.5 s; a faster variant
    # of each (another framework or mode) stays in make test.
    "docs/pruning.md::pruning.md",
    "tests/test_decode.py::test_every_step_of_a_while_loop_decode_equals_a_python_loop[eager]",
    "tests/test_stats.py::test_equal_numpy_on_captured_values_and_gradients[eager]",
    "tests/test_harvest_faults.py::test_cli_batches_already_in_the_store",
    "tests/test_stats.py::test_optax_train_step_under_nnx_jit",
    "tests/test_ops.py::test_vmap_around_the_model_adds_the_batch_axis_in_front",
    "docs/shapes.md::shapes.md",
    "tests/test_recompile_warning.py::test_a_closure_over_a_new_array_each_call_warns_once_with_the_fix",
    "tests/test_cli.py::test_gradflow_of_a_scanned_model_has_one_point_per_layer",
    "tests/test_cli.py::test_python_dash_m_hookax_and_lazy_imports",
    "tests/test_cli.py::test_gradflow_png",
    "tests/test_stats.py::test_vmap_inside_the_model_gives_one_value_per_example[eager]",
    "tests/test_stats.py::test_no_activation_sized_memory_per_layer",
    "tests/test_ops.py::test_mha_probabilities_equal_sow_weights[eager]",
    "tests/test_ops.py::test_bad_edits_and_operations_without_a_gradient_raise_clearly",
    "docs/layers.md::layers.md",
    "tests/test_harvest_faults.py::test_cli_store_replaced_midway_then_rerun_resumes",
    "tests/test_patching.py::test_positions_masks_indices_and_chunks_give_the_same_grid",
    "tests/test_cli_errors.py::test_out_and_overwrite",
    "tests/test_transforms.py::test_scanned_decoder_equals_python_loop[eager]",
    "docs/summary.md::summary.md",
    "tests/test_cli.py::test_gradflow_of_equinox_and_linen_factories",
    "tests/test_reliability_sharding.py::test_backward_hooks[eager]",
    "tests/test_summary.py::test_depth_folds_into_parent_rows",
    "tests/test_nonfinite.py::test_nan_injected_backward_only",
    "tests/test_patching.py::test_patching_equals_the_hand_patched_model[nnx-eager]",
    "tests/test_stats.py::test_scanned_stack_gives_one_value_per_layer[eager]",
    "tests/test_docs_site.py::test_api_page_shows_every_docstring_example_as_a_code_block",
    "tests/test_summary.py::test_against_nnx_tabulate_counts_bytes_and_flops",
    "tests/test_reliability_sharding.py::test_value_and_grad_of_activations[eager]",
    "tests/test_display.py::test_cli_tables_fit_80_columns_and_keep_every_number[summary]",
    "tests/test_patching.py::test_patching_equals_the_hand_patched_model[linen-eager]",
    "tests/test_ops.py::test_linen_and_equinox_operations",
    "docs/design.md::design.md",
    "tests/test_stats.py::test_every_framework[eager-nnx]",
    "tests/test_cli_interrupt.py::test_in_process_ctrl_c_returns_130_with_one_line",
    "tests/test_scan_layers.py::test_intercept_op_and_op_capture_of_one_layer[eager]",
    "tests/test_stats.py::test_scanned_stack_gives_one_value_per_layer[nnx.jit]",
    "tests/test_invisible.py::test_import_order_does_not_matter[hookax-first]",
    "tests/test_cli_errors.py::test_where[gradflow]",
    "tests/test_frameworks.py::test_equinox_library_layers_paths_and_internal_wrappers",
    "tests/test_decode.py::test_a_decode_with_static_bounds_gives_every_steps_value_and_gradient",
    "tests/test_decode.py::test_nested_while_loops_and_a_while_loop_inside_a_scan",
    "tests/test_decode.py::test_vmap_over_prompts_gives_each_prompt_its_own_steps",
    "tests/test_transforms.py::test_linen_scan_and_vmap",
    "tests/test_patching.py::test_patching_equals_the_hand_patched_model[equinox-jit]",
    "docs/migrating.md::migrating.md",
    "tests/test_cli_errors.py::test_where[harvest]",
    "tests/test_stats.py::test_one_layer_selection[eager]",
    "tests/test_sae.py::test_splice_identity_recovers_all_and_zeros_nothing",
    "tests/test_decode.py::test_a_decode_that_stops_early_fills_the_rows_it_did_not_reach",
    "tests/test_cli_errors.py::test_an_input_that_does_not_fit_is_an_input_mismatch[gradflow]",
    "tests/test_harvest_faults.py::test_a_file_at_or_above_the_store_is_refused_before_any_work",
    "tests/test_transforms.py::test_scanned_decoder_activation_gradients_equal_python_loop[eager]",
    "tests/test_patching.py::test_stack_layers_is_one_layout_for_unrolled_and_scanned_stacks",
    "tests/test_summary.py::test_memory_estimate_against_xla_memory_analysis",
    "tests/test_sae.py::test_splice_on_linen_and_equinox[linen]",
    "tests/test_ops_traced.py::test_a_per_head_grid_vmapped_over_patch_values[eager]",
    "tests/test_frameworks.py::test_linen_paths_through_lifted_transforms_setup_not_a_call_site",
    "tests/test_transforms.py::test_jax_jit_forward_with_model_and_cache_arguments",
    "tests/test_reliability_threads.py::test_threads_see_only_their_own_interceptors_and_hooks",
    "tests/test_patching.py::test_patching_equals_the_hand_patched_model[linen-jit]",
    "tests/test_display.py::test_piped_output_keeps_its_natural_width",
    "tests/test_invisible.py::test_import_order_does_not_matter[flax-first]",
    "tests/test_stats.py::test_calls_stacked_aux_argnums_and_integer_outputs[eager]",
    "tests/test_cli.py::test_gradflow_of_a_factory",
    "tests/test_patching.py::test_one_layer_of_a_scanned_stack_by_suffix",
    "tests/test_summary.py::test_variables_listed_on_request_and_train_switch",
    "tests/test_patching.py::test_patching_equals_the_hand_patched_model[nnx-jit]",
    "tests/test_frameworks.py::test_equinox_activation_grads_equal_tree_at_perturbation",
    "tests/test_stats.py::test_scanned_stack_gives_one_value_per_layer[jax.jit]",
    "tests/test_scan_layers.py::test_gradients_through_a_one_layer_edit_equal_the_hand_edited_stack",
    "tests/test_recompile_warning.py::test_scoped_hooks_over_new_objects_warn",
    "tests/test_invisible.py::test_equinox_jit_vmap_no_leak_with_a_scope_active",
    "tests/test_sae.py::test_cli_harvest_linen",
    "tests/test_ops.py::test_edits_are_part_of_the_jit_cache_key",
    "tests/test_cli_errors.py::test_row_axes",
    "tests/test_reliability_sharding.py::test_the_model_is_sharded",
    "tests/test_stats.py::test_vmap_around_the_step",
    "tests/test_pytorch_parity.py::test_hook_cpp[eager]",
    "tests/test_summary.py::test_example_parameter_counts_exact[resnet-78042]",
    "tests/test_ops.py::test_linen_scan_and_equinox_vmap_inside_the_model",
    "tests/test_invisible.py::test_nnx_jit_vmap_no_leak_with_a_scope_active",
    "tests/test_display.py::test_notebook_html_of_summary_and_ops",
    "tests/test_stats.py::test_sharded_batch_equals_unsharded",
    "tests/test_scan_layers.py::test_lax_scan_over_equinox_layers[eager]",
    "tests/test_ops.py::test_a_noop_edit_compiles_to_the_same_optimized_hlo",
    "tests/test_harvest_progress.py::test_cli_names_the_model_and_states_one_throughput",
    "tests/test_capture_grad.py::test_scan_inside_equals_hand_threaded_perturbation[eager]",
    "docs/index.md::index.md",
    "tests/test_cli.py::test_gradflow_checks_out_before_any_work",
    "tests/test_tl_equinox.py::test_capture_by_name_equals_the_hand_forward[eager]",
    "tests/test_tl_equinox.py::test_patch_head_every_equals_the_hand_patched_forward",
    "tests/test_tl_equinox.py::test_patch_block_every_on_one_example_axes",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
