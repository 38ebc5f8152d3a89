import os

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_TESTS = os.path.join(HERE, "gpu")


def pytest_configure(config):
    """Triton kernels run on CPU (the interpreter) in the suite, unless the run is tests/gpu alone: there the
    kernels and FlexAttention's inductor kernels must be compiled for the GPU. Decided before any test module
    imports a kernel (a kernel defined under the interpreter stays interpreted)."""
    paths = [os.path.abspath(str(arg).split("::")[0]) for arg in config.args]
    if paths and all(p == GPU_TESTS or p.startswith(GPU_TESTS + os.sep) for p in paths):
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- tiers ---------------------------------------------------------------------------------------------
# Every test is in one tier, by its file (a test may also mark itself `quality` or `scripts`):
#   unit     the library's behaviour, called directly (the quick tier: `python -m pytest -m unit`)
#   scripts  commands, benchmarks, examples, the laboratory and the repository's own checks, run as a user
#            runs them (console commands, benchmark mains, GPU-script argument parsing, the results page)
#   quality  the shipped students' and the testbed teacher's answers on fixed problems (CPU, minutes)
SCRIPTS = {
    "test_chunk_host_ops_benchmark.py", "test_distributed_cpu.py", "test_dms_train_eval.py", "test_doc_paths.py",
    "test_evaluate.py", "test_example_generate.py", "test_fsdp2_lora_cpu.py", "test_generate_call_speed.py",
    "test_generate_traces.py", "test_generated_data.py", "test_lm_eval_throughput.py", "test_generation_speed_benchmark.py",
    "test_import_graph.py", "test_kvp.py", "test_leave_families_out.py", "test_leave_families_out_pipeline.py", "test_needed_line_retention.py", "test_oracle_eviction.py",
    "test_oracle_recall_profile.py", "test_packaging.py", "test_peers.py", "test_peers_gpu_call.py", "test_pretrain_teacher.py", "test_provenance.py",
    "test_recall_bound.py", "test_recall_vs_quality.py", "test_repo_size.py", "test_result_tools.py",
    "test_results_page.py", "test_retrofit_cpu.py", "test_retrofit_datasets.py",
    "test_split_model_generation_benchmark.py", "test_streaming_plus.py", "test_testbed_knobs.py",
    "test_testbed_tasks.py", "test_time_budget.py", "test_training_scale_benchmark.py", "test_weight_delta.py",
}
QUALITY = {"test_quality_students.py", "test_quality_decode_regression.py", "test_shipped_checkpoints.py"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        name = os.path.basename(str(item.fspath))
        if item.get_closest_marker("quality") or name in QUALITY:
            tier = "quality"
        elif name in SCRIPTS or item.get_closest_marker("scripts"):
            tier = "scripts"
        else:
            tier = "unit"
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
