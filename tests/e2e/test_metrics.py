"""/metrics after real traffic, parsed with prometheus-client's own text parser."""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import STEP_KINDS

pytestmark = pytest.mark.slow


def scrape(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


def wait_for(base_url: str, condition, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(base_url)
        if condition(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def test_counters_move_by_the_traffic_sent(server) -> None:
    before = wait_for(server.base_url, lambda m: "flare_engine_completions_total" in m)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    sent, outputs = 3, 0
    for i in range(sent):
        response = client.chat.completions.create(model=name, messages=[{"role": "user", "content": f"Say {i}"}],
                                                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        outputs += response.usage.completion_tokens
    done = before["flare_engine_completions_total"] + sent
    after = wait_for(server.base_url, lambda m: m["flare_engine_completions_total"] >= done)
    assert after["flare_engine_completions_total"] == done
    assert after["flare_engine_admissions_total"] - before["flare_engine_admissions_total"] == sent
    assert after["flare_engine_output_tokens_total"] - before["flare_engine_output_tokens_total"] == outputs
    assert after["flare_engine_prompt_tokens_total"] > before["flare_engine_prompt_tokens_total"]
    assert after["flare_engine_live_requests"] == 0 and after["flare_engine_free_pages"] > 0
    assert after["flare_time_to_first_token_seconds_count"] >= before.get(
        "flare_time_to_first_token_seconds_count", 0) + sent
    assert after["flare_engine_queue_time_seconds_count"] >= sent
    assert after["flare_frontend_http_admission_capacity"] > 0 and after["flare_frontend_http_admission_in_use"] == 0
    assert after["flare_engine_launches_decode_total"] + after.get("flare_engine_launches_mixed_total", 0) > 0
    # Per step kind, the steps' tokens: every prompt token not reused from the cache, and one a decode row (each
    # output but a request's first comes from one); and their durations.
    moved = {part: sum(after[f"flare_engine_{part}_{kind}_total"] - before[f"flare_engine_{part}_{kind}_total"]
                       for kind in STEP_KINDS)
             for part in ("launches", "step_tokens", "step_microseconds")}
    computed = (after["flare_engine_prompt_tokens_total"] - before["flare_engine_prompt_tokens_total"]
                - after["flare_engine_reused_tokens_total"] + before["flare_engine_reused_tokens_total"])
    assert moved["step_tokens"] == computed + outputs - sent
    assert moved["launches"] >= sent and moved["step_microseconds"] > 0
