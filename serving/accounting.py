"""What the served traffic would have cost on DeepSeek's hosted API: the number behind a migration.

Prices (per 1M tokens, deepseek-flash = V4.1-Flash, effective 2026-09-10 12:00 Beijing):

| kind | peak CNY | off-peak CNY | peak USD | off-peak USD |
|---|---|---|---|---|
| input, cache hit | 0.04 | 0.02 | 0.006 | 0.003 |
| input, cache miss | 2 | 1 | 0.30 | 0.15 |
| output | 8 | 4 | 1.20 | 0.60 |

The CNY column is the seeds' (shared/seeds, both languages: "cache-hit input 0.02 yuan idle / 0.04
yuan peak, cache-miss input 1 / 2, output 4 / 8"); the USD column is DeepSeek's English pricing page
(api-surface.md §15), which the seeds do not give. Output includes reasoning tokens (§15: billing =
hit x hit price + miss x miss price + output x output price).

Periods: peak is Monday-Friday 09:00-12:00 and 14:00-18:00 Beijing time (UTC+8 all year: China has no
daylight saving time), each interval closed at its start and open at its end (09:00:00 is peak,
12:00:00 is not); everything else is off-peak at half the peak price. The hosted docs also price
Chinese public holidays off-peak (§15; the seeds do not mention them); no holiday list is published
with the prices, so `PricingConfig.holidays` holds the Beijing dates an operator wants off-peak (empty
by default: every weekday is a working day).

Exported on the server's registry (counters, so Prometheus adds `_total`):
- `ced_hosted_equivalent_tokens_total{kind, period}`
- `ced_hosted_equivalent_cost_usd_total{kind, period}`, `ced_hosted_equivalent_cost_cny_total{kind, period}`
with kind in cache_hit_input / cache_miss_input / output and period in peak / off_peak. Costs are
computed in Decimal (exact for the request's returned cost) and added to the float counters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Literal

from prometheus_client import CollectorRegistry, Counter

Period = Literal["peak", "off_peak"]
PERIODS: tuple[str, ...] = ("peak", "off_peak")
KINDS: tuple[str, ...] = ("cache_hit_input", "cache_miss_input", "output")
BEIJING = timezone(timedelta(hours=8), "Asia/Shanghai")
# Half-open [start, end) hours of the peak intervals, Beijing time, Monday-Friday.
PEAK_HOURS: tuple[tuple[int, int], ...] = ((9, 12), (14, 18))
_PER = Decimal(1_000_000)  # prices are per 1M tokens


@dataclasses.dataclass(frozen=True)
class Prices:
    """Prices per 1M tokens in one currency and period."""

    cache_hit_input: Decimal
    cache_miss_input: Decimal
    output: Decimal

    def of(self, kind: str) -> Decimal:
        return getattr(self, kind)


@dataclasses.dataclass(frozen=True)
class PriceTable:
    currency: str  # ISO 4217 code; lower-cased in the metric name
    peak: Prices
    off_peak: Prices

    def prices(self, period: Period) -> Prices:
        return self.peak if period == "peak" else self.off_peak


CNY = PriceTable(
    "CNY",
    peak=Prices(Decimal("0.04"), Decimal("2"), Decimal("8")),
    off_peak=Prices(Decimal("0.02"), Decimal("1"), Decimal("4")),
)
USD = PriceTable(
    "USD",
    peak=Prices(Decimal("0.006"), Decimal("0.30"), Decimal("1.20")),
    off_peak=Prices(Decimal("0.003"), Decimal("0.15"), Decimal("0.60")),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PricingConfig:
    """The hosted price tables and the off-peak holidays (a frozen config; `ServeConfig` nests it)."""

    tables: tuple[PriceTable, ...] = (USD, CNY)
    holidays: frozenset[date] = frozenset()  # Beijing calendar dates priced off-peak

    def __post_init__(self):
        currencies = [t.currency for t in self.tables]
        if len(set(currencies)) != len(currencies):
            raise ValueError(f"pricing tables: a currency is given twice in {currencies}")
        for t in self.tables:
            if not (t.currency.isascii() and t.currency.isalpha()):
                raise ValueError(f"pricing tables: currency must be letters (ISO 4217), got {t.currency!r}")
            for period in PERIODS:
                for kind in KINDS:
                    if t.prices(period).of(kind) < 0:
                        raise ValueError(f"pricing table {t.currency}: {period} {kind} price is negative")


def parse_holidays(value: str) -> frozenset[date]:
    """A CLI value `YYYY-MM-DD,YYYY-MM-DD,...` (Beijing dates) as a set of dates; '' is none."""
    out = set()
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.add(date.fromisoformat(item))
        except ValueError:
            raise ValueError(f"pricing holidays: {item!r} is not a date in the form YYYY-MM-DD") from None
    return frozenset(out)


def period(when: datetime, holidays: Iterable[date] = ()) -> Period:
    """The hosted price period of an instant (timezone-aware), judged on the Beijing clock."""
    if when.utcoffset() is None:
        raise ValueError("period: `when` must be timezone-aware (a naive time has no Beijing hour)")
    local = when.astimezone(BEIJING)
    if local.weekday() >= 5 or local.date() in holidays:
        return "off_peak"
    return "peak" if any(start <= local.hour < end for start, end in PEAK_HOURS) else "off_peak"


@dataclasses.dataclass(frozen=True)
class RequestCost:
    """One request's hosted-equivalent cost: its period and the cost in each configured currency."""

    period: Period
    cost: dict[str, Decimal]  # currency -> amount


class CostLedger:
    """Prices each finished request and adds it to the Prometheus counters (thread-safe: the counters
    are, and the ledger keeps no other state)."""

    def __init__(self, config: PricingConfig | None = None, registry: CollectorRegistry | None = None):
        self.config = config or PricingConfig()
        registry = registry if registry is not None else CollectorRegistry()
        self.tokens = Counter(
            "ced_hosted_equivalent_tokens",
            "Tokens served, by hosted billing kind and price period (Beijing time).",
            ["kind", "period"],
            registry=registry,
        )
        self.costs = {
            t.currency: Counter(
                f"ced_hosted_equivalent_cost_{t.currency.lower()}",
                f"What the served tokens would have cost on DeepSeek's hosted API, in {t.currency}.",
                ["kind", "period"],
                registry=registry,
            )
            for t in self.config.tables
        }
        for kind in KINDS:  # every series exists from the start, at 0
            for p in PERIODS:
                self.tokens.labels(kind=kind, period=p)
                for counter in self.costs.values():
                    counter.labels(kind=kind, period=p)

    def price(
        self,
        prompt_cache_hit_tokens: int,
        prompt_cache_miss_tokens: int,
        completion_tokens: int,
        when: datetime,
    ) -> RequestCost:
        """The cost of a request, without counting it."""
        counts = _counts(prompt_cache_hit_tokens, prompt_cache_miss_tokens, completion_tokens)
        p = period(when, self.config.holidays)
        amounts = self._amounts(counts, p)
        return RequestCost(p, {c: sum(by_kind.values(), Decimal(0)) for c, by_kind in amounts.items()})

    def record(
        self,
        prompt_cache_hit_tokens: int,
        prompt_cache_miss_tokens: int,
        completion_tokens: int,
        when: datetime,
    ) -> RequestCost:
        """Price a finished request (`when`: its completion time, timezone-aware) and count it."""
        counts = _counts(prompt_cache_hit_tokens, prompt_cache_miss_tokens, completion_tokens)
        p = period(when, self.config.holidays)
        amounts = self._amounts(counts, p)
        for kind, n in counts.items():
            if n:
                self.tokens.labels(kind=kind, period=p).inc(n)
                for currency, by_kind in amounts.items():
                    self.costs[currency].labels(kind=kind, period=p).inc(float(by_kind[kind]))
        return RequestCost(p, {c: sum(by_kind.values(), Decimal(0)) for c, by_kind in amounts.items()})

    def _amounts(self, counts: dict[str, int], p: Period) -> dict[str, dict[str, Decimal]]:
        return {
            t.currency: {kind: n * t.prices(p).of(kind) / _PER for kind, n in counts.items()}
            for t in self.config.tables
        }


def _counts(hit: int, miss: int, completion: int) -> dict[str, int]:
    counts = {"cache_hit_input": hit, "cache_miss_input": miss, "output": completion}
    names = {"cache_hit_input": "prompt_cache_hit_tokens", "cache_miss_input": "prompt_cache_miss_tokens"}
    for kind, n in counts.items():
        field = names.get(kind, "completion_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cost ledger: {field} must be a non-negative integer, got {n!r}")
    return counts
