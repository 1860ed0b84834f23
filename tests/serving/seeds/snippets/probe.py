import os
import requests

BASE = "https://api.deepseek.com"
KEY = "your-deepseek-api-key"
HEADERS = {
    "Authorization": f"Bearer {KEY}",
    "Content-Type": "application/json",
}

# 1) Connectivity and model name confirmation: the official API model name is deepseek-flash
def probe():
    payload = {
        "model": "deepseek-flash",
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 8,
    }
    r = requests.post(f"{BASE}/chat/completions",
                      headers=HEADERS, json=payload, timeout=30)
    r.raise_for_status()
    return r.json()

# 2) Local weight memory budget for 552B total parameters
TOTAL_PARAMS = 552_000_000_000  # officially announced total parameters
BYTES = {"bf16": 2.0, "fp8_mix": 1.4}  # equivalent byte coefficients for mixed precision

def weight_budget(n_gpus, per_gpu_gb, dtype="bf16"):
    total_gb = TOTAL_PARAMS * BYTES[dtype] / (1024 ** 3)
    capacity = n_gpus * per_gpu_gb
    return {
        "weight_requirement_GB": round(total_gb, 1),
        "cluster_capacity_GB": capacity,
        "headroom_GB": round(capacity - total_gb, 1),
        "fully_resident": capacity >= total_gb,
    }

if __name__ == "__main__":
    print(probe()["choices"][0]["message"]["content"])
    print(weight_budget(8, 80))     # single machine 8x80GB BF16
    print(weight_budget(16, 80, "fp8_mix"))  # two machines 16x80GB mixed precision
