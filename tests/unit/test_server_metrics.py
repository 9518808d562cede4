"""ServerMetrics from engine stats: KV gauges follow every step, speculative decoding counters add up."""

from llmserve.engine.messages import SchedulerStats, SpecDecodeStats
from llmserve.server.metrics import ServerMetrics
from llmserve.server.testing import metric_value


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
