"""Planning a deployment: the capacity ledgers (`capacity`) and the compiled proof (`compile_proof`)."""
