"""Reading the model's checkpoints: the layout of the released HF checkpoint (`mapping`: every
tensor's name, shape, stored dtype and where it goes in our parameter tree), the validating loader
of that layout (`hf_loader`), and the layout and reader of a `convert_weights` output
(`converted`). The converter (`conversion.convert`) writes with these; the model package needs
nothing above itself to load weights."""
