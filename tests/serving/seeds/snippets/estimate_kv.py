import requests

BASE = "https://api.deepseek.com"
KEY = "your-deepseek-api-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

KV_BYTES_PER_TOKEN = 890          # Official: V4.1-Flash about 890 bytes/token
KV_V4_FLASH = 3514                # Official: V4 Flash about 3514 bytes/token

def estimate_kv(text: str, concurrency: int = 1):
    payload = {
        "model": "deepseek-flash",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
    }
    r = requests.post(f"{BASE}/chat/completions",
                      headers=HEADERS, json=payload, timeout=60)
    r.raise_for_status()
    usage = r.json().get("usage", {})
    pt = usage.get("prompt_tokens", 0)
    kv_new = pt * KV_BYTES_PER_TOKEN / (1024 ** 2)
    kv_old = pt * KV_V4_FLASH / (1024 ** 2)
    return {
        "prompt_tokens": pt,
        "KV_MB_新": round(kv_new * concurrency, 2),
        "KV_MB_旧": round(kv_old * concurrency, 2),
        "压缩比": round(kv_old / kv_new, 2),  # Expected about 4.0
    }

if __name__ == "__main__":
    long_text = "部署测试。" * 2000
    print(estimate_kv(long_text, concurrency=32))
