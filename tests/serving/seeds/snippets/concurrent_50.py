import os
import asyncio
import httpx

API_KEY = os.environ.get("DEEPSEEK_API_KEY", "your-deepseek-api-key")
BASE_URL = "https://api.deepseek.com"
MODEL = "deepseek-flash"
MAX_CONCURRENCY = int(os.environ.get("DS_MAX_CONCURRENCY", "2200"))

sem = asyncio.Semaphore(MAX_CONCURRENCY)

async def call_flash(client, messages, thinking="high"):
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8192,
        "thinking": {"type": "enabled", "effort": thinking},
        "stream": False,
    }
    async with sem:
        for attempt in range(5):
            try:
                resp = await client.post(
                    f"{BASE_URL}/chat/completions",
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    json=body,
                    timeout=httpx.Timeout(180.0, connect=10.0),
                )
                if resp.status_code == 429:
                    await asyncio.sleep(min(2 ** attempt, 30))
                    continue
                resp.raise_for_status()
                return resp.json()
            except (httpx.ConnectError, httpx.ReadTimeout):
                await asyncio.sleep(min(2 ** attempt, 30))
        raise RuntimeError("deepseek-flash exhausted retries")

async def main():
    limits = httpx.Limits(max_connections=MAX_CONCURRENCY,
                          max_keepalive_connections=MAX_CONCURRENCY // 2)
    async with httpx.AsyncClient(limits=limits, http2=True) as client:
        tasks = [
            call_flash(client, [{"role": "user", "content": f"审计片段 {i}"}])
            for i in range(50)
        ]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        ok = sum(1 for r in results if isinstance(r, dict))
        print(f"ok={ok} failed={len(results) - ok}")

if __name__ == "__main__":
    asyncio.run(main())
