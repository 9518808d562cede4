"""ServerMetrics from engine stats: KV gauges follow every step, speculative decoding counters add up."""

from llmserve.messages import GrammarStats, SchedulerStats, SpecDecodeStats
from llmserve.server.metrics import ServerMetrics
from llmserve.testing.servers import metric_value


def test_kv_gauges_and_spec_counters_follow_scheduler_stats():
    metrics = ServerMetrics("m")
    metrics.on_scheduler_stats(SchedulerStats(num_running=2, kv_cache_usage=0.25, num_kv_blocks=100,
                                              num_free_kv_blocks=75, spec=SpecDecodeStats(2, 8, 5, [2, 2, 1, 0])))
    metrics.on_scheduler_stats(SchedulerStats(num_running=1, kv_cache_usage=0.5, num_kv_blocks=100,
                                              num_free_kv_blocks=50, spec=SpecDecodeStats(1, 4, 4, [1, 1, 1, 1])))
    text = metrics.render().decode()
    assert metric_value(text, "llmserve:kv_cache_blocks") == 100
    assert metric_value(text, "llmserve:kv_cache_free_blocks") == 50
    assert metric_value(text, "llmserve:spec_decode_num_drafts_total") == 3
    assert metric_value(text, "llmserve:spec_decode_num_draft_tokens_total") == 12
    assert metric_value(text, "llmserve:spec_decode_num_accepted_tokens_total") == 9
    assert 'position="0"} 3.0' in text and 'position="3"} 1.0' in text
    assert metric_value(text, "llmserve:spec_decode_acceptance_rate") == 0.75
    assert metric_value(text, "llmserve:spec_decode_mean_accepted_length") == 4.0


def test_grammar_counters_and_compile_histogram_follow_scheduler_stats():
    metrics = ServerMetrics("m")
    metrics.on_scheduler_stats(SchedulerStats(grammar=GrammarStats(3, 1, [0.004, 0.3])))
    metrics.on_scheduler_stats(SchedulerStats(grammar=GrammarStats(2, 2, [])))
    metrics.on_scheduler_stats(SchedulerStats())  # a step without grammars leaves them as they were
    text = metrics.render().decode()
    assert metric_value(text, "llmserve:grammar_cache_queries_total") == 5
    assert metric_value(text, "llmserve:grammar_cache_hits_total") == 3
    assert metric_value(text, "llmserve:grammar_compile_seconds_count") == 2
    assert metric_value(text, "llmserve:grammar_compile_seconds_sum") == 0.304
    assert 'llmserve:grammar_compile_seconds_bucket{le="0.001",model_name="m"} 0.0' in text
    assert 'llmserve:grammar_compile_seconds_bucket{le="0.005",model_name="m"} 1.0' in text
    assert 'llmserve:grammar_compile_seconds_bucket{le="10.0",model_name="m"} 2.0' in text


def test_expert_load_histogram_observes_moe_steps_only():
    metrics = ServerMetrics("m")
    metrics.on_scheduler_stats(SchedulerStats(expert_balance=1.2))
    metrics.on_scheduler_stats(SchedulerStats(expert_balance=3.5))
    metrics.on_scheduler_stats(SchedulerStats())  # a dense model's step
    text = metrics.render().decode()
    assert metric_value(text, "llmserve:moe_expert_load_max_over_mean_count") == 2
    assert metric_value(text, "llmserve:moe_expert_load_max_over_mean_sum") == 4.7
    assert 'llmserve:moe_expert_load_max_over_mean_bucket{le="1.25",model_name="m"} 1.0' in text


def test_resident_adapters_are_a_gauge_per_adapter_name():
    metrics = ServerMetrics("tiny")
    metrics.on_scheduler_stats(SchedulerStats(resident_loras=["sql", "chat"]))
    metrics.on_scheduler_stats(SchedulerStats(resident_loras=["chat", "math"]))  # sql swapped out for math
    text = metrics.render().decode()
    for name, value in (("sql", 0.0), ("chat", 1.0), ("math", 1.0)):
        assert f'llmserve:lora_adapter_resident{{lora_name="{name}",model_name="tiny"}} {value}' in text
    assert metrics.resident_loras == {"chat", "math"}
    metrics.on_scheduler_stats(SchedulerStats())  # LoRA off: nothing said, nothing changed
    assert metrics.resident_loras == {"chat", "math"}
