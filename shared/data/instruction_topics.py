"""Templates and curated word lists for the instruction part of the prompt mix (shared/data/prompt_mix.py).

Each family pairs a few phrasings with the word list they fill. The lists are broad on purpose (science, money,
computing, history, health, daily life, work, travel, food, arts), so that templates x topics covers the kinds of
request users send a chat model; the arithmetic problems are generated in prompt_mix.py from their templates here.
"""

# One line holds several items: the lists read as lists, not as hundreds of one-word lines.
# fmt: off

# Creative writing: {topic}, and {style} for the styled piece.
CREATIVE_TEMPLATES = (
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a limerick about {topic}.",
    "Write a short story of under 300 words about {topic}.",
    "Write the opening paragraph of a novel about {topic}.",
    "Write a short dialogue between two characters about {topic}.",
    "Describe {topic} using all five senses.",
    "Write song lyrics, one verse and a chorus, about {topic}.",
)
STYLED_TEMPLATE = "Write a short piece about {topic} in the style of {style}."
CREATIVE_TOPICS = (
    "the ocean at dawn", "a forgotten library", "autumn leaves", "a city in the rain", "the first snow of winter",
    "a lighthouse keeper", "the last day of summer", "a robot learning to paint", "an old bicycle",
    "a busy train station", "moving to a new city", "a cup of morning coffee", "the night sky",
    "a grandmother's kitchen", "a lost umbrella", "a mountain village", "a journey across the desert", "friendship",
    "starting a new job", "a thunderstorm", "a garden in spring", "the moon landing", "a stray cat",
    "a small bookshop", "a long road trip", "learning to swim", "a winter market", "the first day of school",
    "a message in a bottle", "a jazz club", "a rainy Sunday", "a bridge at night", "time travel",
    "a village festival", "a cabin in the woods", "an astronaut far from home", "a chess match", "a river",
    "a lost key", "a travelling circus", "a sleeping volcano", "a submarine", "a haunted house",
    "a dragon who is afraid of fire", "a detective's last case", "a time capsule", "a kite festival",
    "an old photograph", "a bakery at four in the morning", "a migrating bird", "a snowed-in weekend",
    "a secret garden", "a broken clock", "a farewell at an airport", "the first rain after a drought",
    "a street musician", "a treehouse", "a night shift at a hospital", "a fishing boat", "a marathon runner",
    "the smell of old books", "a city power cut", "a childhood home", "the northern lights", "a wedding",
)
STYLES = (
    "a children's picture book", "a hard-boiled detective novel", "a newspaper report", "a nature documentary",
    "a Shakespearean sonnet", "a fairy tale", "a sports commentary", "a product review", "a travel guide",
    "a scientific abstract",
)

# Emails and short messages: {tone} and {situation}.
EMAIL_TEMPLATES = (
    "Write a short {tone} email {situation}.",
    "Draft a {tone} message to send by chat {situation}.",
)
TONES = ("polite", "friendly", "formal", "concise")
EMAIL_SITUATIONS = (
    "asking my manager for a deadline extension", "declining a meeting invitation",
    "thanking a colleague for their help on a project", "requesting two days off next week",
    "following up after a job interview", "apologising to a customer for a delayed shipment",
    "inviting the team to a farewell lunch", "asking my landlord to fix the heating",
    "complaining politely about a noisy neighbour", "introducing myself to a new client",
    "reminding a customer about an unpaid invoice", "asking a professor for a recommendation letter",
    "cancelling a gym membership", "rescheduling a doctor's appointment",
    "asking for feedback on a presentation", "welcoming a new team member",
    "telling a supplier that an order arrived damaged", "asking a friend to return a borrowed book",
    "congratulating a colleague on a promotion", "proposing a new weekly meeting time",
    "asking the IT team for access to a shared drive", "announcing that the office will be closed on Friday",
    "requesting a refund for a cancelled flight", "asking a neighbour to water my plants while I travel",
    "turning down a job offer", "asking for a raise", "sharing the notes of a meeting",
    "inviting a speaker to a conference", "apologising for missing a call",
    "asking a teacher about my child's progress",
)

# Explaining concepts: {concept}, {audience} and {count}.
CONCEPT_TEMPLATES = (
    "Explain {concept} in simple terms.",
    "Summarise what {concept} is in three sentences.",
    "What are common misconceptions about {concept}?",
    "Give an everyday analogy that explains {concept}.",
    "Write five quiz questions, with answers, about {concept}.",
    "Why does {concept} matter? Answer in one paragraph.",
    "What are the key ideas someone should understand about {concept}?",
)
AUDIENCE_TEMPLATE = "Explain {concept} to {audience}."
FACTS_TEMPLATE = "List {count} interesting facts about {concept}."
AUDIENCES = (
    "a ten-year-old", "a high-school student", "a busy manager", "someone who never studied science",
    "a software engineer", "my grandmother",
)
FACT_COUNTS = (3, 5, 7)
CONCEPT_WRITING_TEMPLATES = (
    "Write a tweet of under 280 characters that explains {concept}.",
    "Write the introduction of a short blog post about {concept}.",
)
CONCEPTS = (
    # science
    "photosynthesis", "black holes", "the theory of evolution", "plate tectonics", "the water cycle",
    "climate change", "the greenhouse effect", "DNA replication", "vaccines", "antibiotic resistance",
    "quantum entanglement", "the speed of light", "gravity", "entropy", "nuclear fusion", "the periodic table",
    "the immune system", "the human heart", "sleep cycles", "the placebo effect", "natural selection",
    "the Big Bang", "ocean tides", "the ozone layer", "magnetism", "electric circuits", "radioactivity",
    "the nitrogen cycle", "volcanoes", "earthquakes",
    # money and society
    "inflation", "compound interest", "supply and demand", "index funds", "credit scores", "opportunity cost",
    "the stock market", "central banks", "taxes on income", "insurance", "cryptocurrency", "globalisation",
    "democracy", "the separation of powers", "game theory", "the tragedy of the commons", "universal basic income",
    # computing
    "recursion", "machine learning", "neural networks", "public-key cryptography", "how the internet routes data",
    "the difference between RAM and storage", "operating systems", "compilers", "databases", "cloud computing",
    "version control", "hash tables", "big-O notation", "containers such as Docker", "DNS", "HTTPS",
    "open-source software", "floating-point numbers", "garbage collection", "APIs",
    "speculative decoding in language models", "the transformer architecture",
    # history and culture
    "the Industrial Revolution", "the Renaissance", "the printing press", "the Silk Road", "the Roman Empire",
    "the Cold War", "the French Revolution", "the invention of writing", "the Olympic Games", "impressionism",
    "the scientific method", "stoicism", "utilitarianism",
    # daily life and health
    "a balanced diet", "mindfulness", "muscle growth", "dehydration", "how caffeine works", "habit formation",
    "procrastination", "the benefits of walking", "time management", "active listening",
)

# Comparisons: two items of one category, {a} and {b}, with the category's {kind}.
COMPARE_TEMPLATES = (
    "Compare {a} and {b} as {kind}: strengths, weaknesses and when to choose each.",
    "What are the main differences between {a} and {b}?",
)
COMPARISON_CATEGORIES: dict[str, tuple[str, ...]] = {
    "programming languages": ("Python", "Rust", "Go", "JavaScript", "Java", "C", "Haskell", "Ruby", "Kotlin", "Swift"),
    "databases": ("PostgreSQL", "MySQL", "SQLite", "MongoDB", "Redis", "Cassandra"),
    "energy sources": ("solar power", "wind power", "nuclear power", "coal", "natural gas", "hydroelectric power"),
    "pets": ("cats", "dogs", "rabbits", "parrots", "hamsters", "goldfish"),
    "travel destinations": ("Paris", "Tokyo", "New York", "London", "Berlin", "Sydney", "Toronto", "Mumbai"),
    "ways to travel": ("trains", "planes", "buses", "cars", "bicycles", "ferries"),
    "data structures": ("arrays", "linked lists", "hash tables", "binary search trees", "heaps", "tries"),
    "ways to learn": ("online courses", "textbooks", "private tutoring", "study groups", "learning by doing"),
    "sports": ("football", "basketball", "tennis", "swimming", "cycling", "running"),
    "investments": ("stocks", "bonds", "real estate", "savings accounts", "gold"),
    "cooking methods": ("baking", "frying", "steaming", "grilling", "boiling", "slow cooking"),
}

# Arguments on both sides: {debate}.
DEBATE_TEMPLATES = (
    "Give the strongest arguments for and against {debate}.",
    "Write a balanced paragraph on whether {debate} is a good idea.",
)
DEBATES = (
    "working from home", "a four-day working week", "banning cars from city centres", "school uniforms",
    "nuclear power", "space exploration", "homework for young children", "social media for teenagers",
    "self-driving cars", "a universal basic income", "learning Latin at school", "zoos", "cash-free payments",
    "daylight saving time", "remote learning", "open-plan offices", "standardised tests", "tipping in restaurants",
    "electric scooters in cities", "year-round schooling",
)

# Practical how-to: {task} and {count}.
HOW_TO_TEMPLATES = (
    "Explain step by step how to {task}.",
    "What are the most common mistakes people make when they try to {task}?",
    "Write a beginner's checklist to {task}.",
    "I have never done this before: how do I {task}?",
)
TIPS_TEMPLATE = "Give me {count} tips to {task}."
TIP_COUNTS = (3, 5, 10)
HOW_TO_TASKS = (
    "change a flat tyre", "brew pour-over coffee", "set up a Python virtual environment", "write a cover letter",
    "start a vegetable garden", "prepare for a job interview", "back up a laptop", "learn a new language as an adult",
    "train a puppy to sit", "bake sourdough bread", "plan a monthly budget", "reset a home router",
    "tie a bowline knot", "write a good unit test", "negotiate a salary", "run a productive meeting",
    "clean a cast-iron pan", "prepare for a first marathon", "set up two-factor authentication",
    "undo the last commit in git", "fold a paper aeroplane", "start meditating", "declutter a small wardrobe",
    "plan a birthday party", "paint a room", "give a presentation without notes", "fall asleep faster",
    "read more books", "save money on groceries", "write a research paper", "study for an exam",
    "make a website with plain HTML", "learn to play the guitar", "take better photos with a phone",
    "keep houseplants alive", "cook rice on the stove", "make new friends in a new city", "pack light for a trip",
    "write a clear bug report", "onboard a new employee", "deal with a difficult customer", "start running",
    "brew green tea", "debug a slow SQL query", "prepare for a power outage", "teach a child to ride a bike",
    "reduce screen time", "write a eulogy", "choose a laptop", "set up a home network printer",
)

# Programming questions without code to read: {task} in {language}.
PROGRAMMING_TEMPLATES = (
    "How do I {task} in {language}?",
    "Write a {language} snippet to {task}, with a short explanation.",
)
PROGRAMMING_LANGUAGES = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "Bash")
PROGRAMMING_TASKS = (
    "read a CSV file", "reverse a string", "sort a list of records by one field", "make an HTTP GET request",
    "parse a JSON string", "remove duplicates from a list", "read a file line by line",
    "measure how long a function takes", "write text to a file", "handle errors when opening a file",
    "define a class with a constructor", "find the largest number in a list", "format today's date",
    "generate a random integer in a range", "run two tasks concurrently", "check whether a string is a palindrome",
    "merge two sorted lists", "count how often each word appears in a text", "find email addresses with a regex",
    "convert a string to an integer safely", "iterate over the keys and values of a map", "implement binary search",
    "flatten a nested list", "read an environment variable with a default", "split a string on commas",
    "parse command-line arguments", "compute the SHA-256 hash of a file", "compute a factorial recursively",
    "retry a failing network call with backoff", "list the files in a directory",
)

# People and events: {person}, {event}.
PERSON_TEMPLATES = (
    "Who was {person}, and why are they remembered?",
    "What were the most important achievements of {person}?",
)
PEOPLE = (
    "Marie Curie", "Isaac Newton", "Ada Lovelace", "Leonardo da Vinci", "Nelson Mandela", "Albert Einstein",
    "Cleopatra", "Charles Darwin", "Frida Kahlo", "Alan Turing", "Mahatma Gandhi", "Wolfgang Amadeus Mozart",
    "Rosalind Franklin", "Galileo Galilei", "Jane Austen", "Nikola Tesla", "Confucius", "Florence Nightingale",
    "Genghis Khan", "Grace Hopper", "William Shakespeare", "Martin Luther King Jr.", "Hypatia", "Ibn Battuta",
    "Katherine Johnson", "Ludwig van Beethoven", "Queen Elizabeth I", "Simón Bolívar", "Srinivasa Ramanujan",
    "Amelia Earhart", "Louis Pasteur", "Maya Angelou", "Napoleon Bonaparte", "Rachel Carson", "Tim Berners-Lee",
    "Vincent van Gogh", "Harriet Tubman", "Johannes Gutenberg", "Dmitri Mendeleev", "Emmy Noether",
)
EVENT_TEMPLATES = (
    "What happened during {event}, and why does it matter today?",
    "Explain the causes and consequences of {event}.",
)
EVENTS = (
    "the fall of the Berlin Wall", "the first Moon landing", "the invention of the telephone",
    "the building of the Great Wall of China", "the Black Death", "the signing of the Magna Carta",
    "the discovery of penicillin", "the eruption of Mount Vesuvius in 79 AD", "the Wright brothers' first flight",
    "the launch of Sputnik", "the 2008 financial crisis", "the end of apartheid in South Africa",
    "the first transatlantic telegraph cable", "the opening of the Suez Canal", "the Meiji Restoration",
    "the discovery of the structure of DNA", "the Apollo 13 mission", "the creation of the World Wide Web",
    "the Chernobyl disaster", "the Human Genome Project",
)

# Translation: {sentence} into {language}.
TRANSLATE_TEMPLATE = 'Translate into {language}: "{sentence}"'
LANGUAGES = (
    "French", "Spanish", "German", "Italian", "Portuguese", "Japanese", "Chinese", "Korean", "Russian", "Arabic",
    "Dutch", "Hindi",
)
SENTENCES = (
    "Where is the nearest train station?", "I would like a table for two, please.",
    "The meeting has been moved to Thursday afternoon.", "Could you speak a little more slowly?",
    "My flight was cancelled and I need a hotel for tonight.", "Thank you for your help, you have been very kind.",
    "How much does this cost?", "I am allergic to peanuts.", "The museum is closed on Mondays.",
    "Please send me the report by Friday.", "It is going to rain tomorrow.", "I have lived here for three years.",
    "Can you recommend a good restaurant nearby?", "The children are playing in the garden.",
    "I lost my phone yesterday.", "We are looking forward to seeing you next week.",
    "This software update fixes several security issues.", "What time does the shop open?",
    "My favourite season is autumn.", "Happy birthday, I hope all your wishes come true.",
    "The train is twenty minutes late.", "I need to see a doctor.", "Turn left at the second traffic light.",
    "She has been learning to play the piano since she was six.", "Could I have the bill, please?",
    "The library books are due back on Monday.", "Our team won the match last night.",
    "Do you accept credit cards?", "I am sorry, I did not understand the question.",
    "The package will arrive within five working days.",
)

REWRITE_TEMPLATES = (
    'Rewrite this sentence to sound more formal: "{sentence}"',
    'Rewrite this sentence in a casual, friendly tone: "{sentence}"',
    'Explain the grammar of this sentence, word by word: "{sentence}"',
)

# Everyday planning: {dish}, {city}, {days}, {season}.
RECIPE_TEMPLATES = (
    "Give me a simple recipe for {dish}.",
    "How can I make a vegetarian version of {dish}?",
    "Write a shopping list for cooking {dish} for four people.",
)
DISHES = (
    "lasagne", "chicken curry", "pancakes", "a Greek salad", "tomato soup", "banana bread", "fried rice", "guacamole",
    "a vegetable stir-fry", "chocolate chip cookies", "paella", "shakshuka", "a mushroom risotto", "chili con carne",
    "apple pie", "hummus", "pad thai", "a Spanish omelette", "lentil soup", "tacos",
)
TRIP_TEMPLATE = "Plan a {days}-day trip to {city} for a first-time visitor."
PACKING_TEMPLATE = "What should I pack for a trip to {city} in {season}?"
TRIP_DAYS = (2, 3, 5)
SEASONS = ("spring", "summer", "autumn", "winter")
CITIES = (
    "Paris", "Tokyo", "New York", "London", "Rome", "Barcelona", "Istanbul", "Bangkok", "Cape Town", "Mexico City",
    "Buenos Aires", "Reykjavik", "Kyoto", "Lisbon", "Prague", "Vienna", "Marrakesh", "Singapore", "Sydney",
    "Vancouver",
)
NAMING_TEMPLATE = "Suggest {count} names for {thing}, with one sentence on each."
NAMING_THINGS = (
    "a coffee shop", "a fantasy kingdom", "a golden retriever puppy", "a productivity app", "a podcast about history",
    "a bakery", "a startup that recycles batteries", "a school robotics team", "a sailing boat", "a board game",
    "a book club", "a hiking group", "a hot-sauce brand", "a science newsletter", "a video game villain",
)
NAMING_COUNTS = (5, 10)

# Arithmetic and word problems: each template's fields are drawn from the ranges next to it (prompt_mix.py).
ARITHMETIC_TEMPLATES: tuple[tuple[str, dict[str, tuple[int, int]]], ...] = (
    ("What is {a} × {b}? Show your working.", {"a": (12, 999), "b": (3, 99)}),
    ("What is {a} + {b} - {c}?", {"a": (100, 9999), "b": (10, 999), "c": (10, 999)}),
    ("What is {a} divided by {b}, to two decimal places?", {"a": (100, 9999), "b": (3, 97)}),
    ("What is {p}% of {x}?", {"p": (5, 95), "x": (20, 5000)}),
    (
        "A shop sells pencils at {p} cents each. How much do {n} pencils cost, in dollars?",
        {"p": (15, 95), "n": (6, 250)},
    ),
    ("A train travels {d} km in {h} hours. What is its average speed?", {"d": (60, 900), "h": (2, 9)}),
    (
        "A recipe for {s} people needs {g} grams of flour. How much flour is needed for {t} people?",
        {"s": (2, 6), "g": (150, 800), "t": (3, 20)},
    ),
    ("A rectangle is {w} cm wide and {l} cm long. What are its area and perimeter?", {"w": (2, 60), "l": (3, 90)}),
    ("Is {n} a prime number? Explain how you checked.", {"n": (50, 2000)}),
    ("Convert {c} degrees Celsius to Fahrenheit, and show the formula.", {"c": (-30, 45)}),
    (
        "I save {m} dollars a month. How many months until I have {t} dollars, and how much will be left over?",
        {"m": (25, 400), "t": (1000, 20000)},
    ),
    (
        "A car uses {l} litres of fuel per 100 km. How much fuel does a {d} km trip need?",
        {"l": (4, 12), "d": (35, 1200)},
    ),
)
ARITHMETIC_PER_TEMPLATE = 80
# fmt: on
