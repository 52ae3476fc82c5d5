"""DeepSeek V2/V3 model: configuration, checkpoint loading and layers written against backend ops."""
