import json
import requests

BASE = "https://api.deepseek.com"
KEY = "your-deepseek-api-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

ALLOWED_TOOLS = {"get_weather", "search_docs"}
SCHEMA = {"name": str, "score": (int, float)}  # expected structured fields

def call_json(prompt: str):
    payload = {
        "model": "deepseek-flash",
        "messages": [{"role": "user", "content": prompt}],
        "response_format": {"type": "json_object"},
        "max_tokens": 1024,
    }
    r = requests.post(f"{BASE}/chat/completions",
                      headers=HEADERS, json=payload, timeout=120)
    r.raise_for_status()
    text = r.json()["choices"][0]["message"]["content"]
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return {"ok": False, "reason": "invalid_json"}
    for k, typ in SCHEMA.items():
        if k not in data or not isinstance(data[k], typ):
            return {"ok": False, "reason": f"bad_field:{k}"}
    return {"ok": True, "data": data}

def validate_tool_calls(msg):
    calls = msg.get("tool_calls") or []
    for c in calls:
        name = c.get("function", {}).get("name")
        if name not in ALLOWED_TOOLS:
            raise ValueError(f"tool not allowed: {name}")
    return calls

if __name__ == "__main__":
    print(call_json("Output a JSON containing name and score fields"))
