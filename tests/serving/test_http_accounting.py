"""The hosted-equivalent cost ledger (serving/accounting.py): price periods on the Beijing clock,
the cost of a request computed by hand from the seeds' table, and the Prometheus counters."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from prometheus_client import CollectorRegistry

from serving.accounting import CostLedger, PricingConfig, parse_holidays, period

BJ = timezone(timedelta(hours=8))
PACIFIC = timezone(timedelta(hours=-8))
# 2026-12-01 is a Tuesday; 2026-12-04 Friday; 12-05 Saturday; 12-06 Sunday; 12-07 Monday.
TUE, FRI, SAT, SUN, MON = 1, 4, 5, 6, 7


def bj(day: int, hour: int, minute: int = 0, second: int = 0) -> datetime:
    return datetime(2026, 12, day, hour, minute, second, tzinfo=BJ)


@pytest.mark.parametrize(
    ("hm", "expected"),
    [
        ((0, 0), "off_peak"),
        ((8, 59), "off_peak"),
        ((9, 0), "peak"),
        ((11, 59), "peak"),
        ((12, 0), "off_peak"),
        ((13, 59), "off_peak"),
        ((14, 0), "peak"),
        ((17, 59), "peak"),
        ((18, 0), "off_peak"),
        ((23, 59), "off_peak"),
    ],
)
def test_weekday_boundaries(hm, expected):
    for day in (TUE, FRI, MON):
        assert period(bj(day, *hm)) == expected


def test_seconds_at_the_edges():
    assert period(bj(TUE, 8, 59, 59)) == "off_peak"
    assert period(bj(TUE, 11, 59, 59)) == "peak"
    assert period(bj(TUE, 17, 59, 59)) == "peak"


@pytest.mark.parametrize("day", [SAT, SUN])
@pytest.mark.parametrize("hour", [9, 10, 15, 17])
def test_weekends_are_off_peak(day, hour):
    assert period(bj(day, hour)) == "off_peak"


def test_other_offsets_are_judged_on_the_beijing_clock():
    utc = UTC
    # Monday 09:30 Beijing = Monday 01:30 UTC; 18:00 Beijing = 10:00 UTC.
    assert period(datetime(2026, 12, 7, 1, 30, tzinfo=utc)) == "peak"
    assert period(datetime(2026, 12, 7, 0, 59, tzinfo=utc)) == "off_peak"  # 08:59 Beijing
    assert period(datetime(2026, 12, 7, 10, 0, tzinfo=utc)) == "off_peak"  # 18:00 Beijing
    assert period(datetime(2026, 12, 7, 6, 0, tzinfo=utc)) == "peak"  # 14:00 Beijing
    # Sunday 17:30 in UTC-8 is Monday 09:30 in Beijing: peak, although it is Sunday where the client is.
    assert period(datetime(2026, 12, 6, 17, 30, tzinfo=PACIFIC)) == "peak"
    # Friday 18:00 UTC-8 is Saturday 10:00 Beijing: off-peak, although 10:00 is a peak hour.
    assert period(datetime(2026, 12, 4, 18, 0, tzinfo=PACIFIC)) == "off_peak"
    # Friday 23:30 UTC (Saturday 07:30 Beijing) and Sunday 22:00 UTC (Monday 06:00 Beijing).
    assert period(datetime(2026, 12, 4, 23, 30, tzinfo=utc)) == "off_peak"
    assert period(datetime(2026, 12, 6, 22, 0, tzinfo=utc)) == "off_peak"


def test_naive_time_is_refused():
    with pytest.raises(ValueError, match="timezone-aware"):
        period(datetime(2026, 12, 1, 10, 0))


def test_holidays():
    national_day = datetime(2026, 10, 1, 10, 0, tzinfo=BJ)  # a Thursday
    assert period(national_day) == "peak"
    holidays = parse_holidays("2026-10-01, 2026-10-02")
    assert holidays == frozenset({date(2026, 10, 1), date(2026, 10, 2)})
    assert period(national_day, holidays) == "off_peak"
    # The holiday is a Beijing date: 2026-10-01 03:00 UTC is 11:00 on the holiday.
    assert period(datetime(2026, 10, 1, 3, 0, tzinfo=UTC), holidays) == "off_peak"
    assert period(datetime(2026, 10, 1, 3, 0, tzinfo=UTC)) == "peak"
    assert parse_holidays("") == frozenset()
    with pytest.raises(ValueError, match="'2026-13-01'"):
        parse_holidays("2026-10-01,2026-13-01")


def test_cost_of_a_known_request():
    ledger = CostLedger()
    # 12,800 cached + 3,200 uncached prompt tokens, 1,000 output tokens. By hand from the table:
    # peak USD: 12800 x 0.006 + 3200 x 0.30 + 1000 x 1.20 = 76.8 + 960 + 1200 = 2236.8 per 1M -> 0.0022368
    # peak CNY: 12800 x 0.04 + 3200 x 2 + 1000 x 8 = 512 + 6400 + 8000 = 14912 per 1M -> 0.014912
    peak = ledger.record(12_800, 3_200, 1_000, bj(TUE, 10, 30))
    assert peak.period == "peak"
    assert peak.cost == {"USD": Decimal("0.0022368"), "CNY": Decimal("0.014912")}
    off = ledger.record(12_800, 3_200, 1_000, bj(SAT, 10, 30))
    assert off.period == "off_peak"
    assert off.cost == {"USD": Decimal("0.0011184"), "CNY": Decimal("0.007456")}
    # One million output tokens at peak is the table's own number.
    assert ledger.price(0, 0, 1_000_000, bj(TUE, 15)).cost == {"USD": Decimal("1.20"), "CNY": Decimal("8")}
    assert ledger.price(0, 0, 0, bj(TUE, 15)).cost == {"USD": Decimal(0), "CNY": Decimal(0)}


def test_counters_move_by_kind_and_period():
    registry = CollectorRegistry()
    ledger = CostLedger(PricingConfig(), registry)

    def value(name, kind, p):
        return registry.get_sample_value(name, {"kind": kind, "period": p})

    # Every series exists before the first request.
    assert value("ced_hosted_equivalent_cost_usd_total", "output", "off_peak") == 0.0
    ledger.record(12_800, 3_200, 1_000, bj(TUE, 10, 30))
    assert value("ced_hosted_equivalent_tokens_total", "cache_hit_input", "peak") == 12_800
    assert value("ced_hosted_equivalent_tokens_total", "cache_miss_input", "peak") == 3_200
    assert value("ced_hosted_equivalent_tokens_total", "output", "peak") == 1_000
    assert value("ced_hosted_equivalent_cost_usd_total", "cache_hit_input", "peak") == 7.68e-05
    assert value("ced_hosted_equivalent_cost_usd_total", "cache_miss_input", "peak") == 9.6e-04
    assert value("ced_hosted_equivalent_cost_usd_total", "output", "peak") == 1.2e-03
    assert value("ced_hosted_equivalent_cost_cny_total", "output", "peak") == 8e-03
    assert value("ced_hosted_equivalent_tokens_total", "output", "off_peak") == 0
    ledger.record(0, 500, 2_000, datetime(2026, 12, 5, 3, 0, tzinfo=UTC))  # Saturday
    assert value("ced_hosted_equivalent_tokens_total", "output", "off_peak") == 2_000
    assert value("ced_hosted_equivalent_cost_usd_total", "output", "off_peak") == pytest.approx(1.2e-03)
    assert value("ced_hosted_equivalent_cost_cny_total", "cache_miss_input", "off_peak") == 5e-04
    assert value("ced_hosted_equivalent_tokens_total", "output", "peak") == 1_000  # unchanged
    # price() does not count.
    ledger.price(10, 10, 10, bj(TUE, 10))
    assert value("ced_hosted_equivalent_tokens_total", "output", "peak") == 1_000


def test_bad_token_counts_name_the_field():
    ledger = CostLedger()
    with pytest.raises(ValueError, match="prompt_cache_miss_tokens"):
        ledger.record(0, -1, 0, bj(TUE, 10))
    with pytest.raises(ValueError, match="completion_tokens"):
        ledger.record(0, 0, 1.5, bj(TUE, 10))
    with pytest.raises(ValueError, match="prompt_cache_hit_tokens"):
        ledger.record(True, 0, 0, bj(TUE, 10))
