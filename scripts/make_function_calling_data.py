"""Generate a function-calling SFT data set (JSONL chats), in the spirit of Glaive function-calling data.

  python scripts/make_function_calling_data.py --num-examples 20000 --seed 0 --output /tmp/fc.jsonl

Each record is {"messages": [...]} with roles system / user / assistant / tool. The system message
declares tools as JSON schemas inside <tools></tools>; the assistant calls one by answering
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; the tool message holds the JSON result;
the assistant then answers from it. Conversation kinds: a single call, a call after asking the user
for missing details, two calls in one chat, and a polite refusal when no declared tool fits.
Every argument is stated in the user's words (a company name maps to its ticker, a spelled-out date
to ISO), so a small model can learn the task and its loss keeps falling. The output is a pure
function of --seed and --num-examples.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CITIES = [
    "Paris",
    "London",
    "Tokyo",
    "New York",
    "Berlin",
    "Madrid",
    "Rome",
    "Sydney",
    "Toronto",
    "Cairo",
    "Mumbai",
    "Seoul",
    "Chicago",
    "Lisbon",
    "Vienna",
    "Prague",
    "Dublin",
    "Oslo",
    "Nairobi",
    "Lima",
    "Bangkok",
    "Istanbul",
    "Athens",
    "Warsaw",
    "Boston",
    "Denver",
    "Zurich",
    "Helsinki",
    "Santiago",
    "Hanoi",
]
CURRENCIES = {
    "USD": 1.0,
    "EUR": 0.92,
    "GBP": 0.79,
    "JPY": 151.2,
    "CAD": 1.36,
    "AUD": 1.52,
    "CHF": 0.88,
    "INR": 83.1,
    "CNY": 7.23,
    "MXN": 16.9,
    "SEK": 10.6,
    "BRL": 5.05,
}
COMPANIES = {
    "Apple": "AAPL",
    "Microsoft": "MSFT",
    "Google": "GOOGL",
    "Amazon": "AMZN",
    "Tesla": "TSLA",
    "Netflix": "NFLX",
    "Nvidia": "NVDA",
    "Meta": "META",
    "Intel": "INTC",
    "IBM": "IBM",
    "Oracle": "ORCL",
    "Adobe": "ADBE",
    "Salesforce": "CRM",
    "Disney": "DIS",
    "Nike": "NKE",
}
CUISINES = ["Italian", "Japanese", "Mexican", "Indian", "Thai", "French", "Chinese", "Greek", "Korean", "Vegan"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
NAMES = ["Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam"]
DOMAINS = ["example.com", "mail.com", "work.org", "company.io"]
UNITS = [
    ("kilometers", "miles", 0.621371),
    ("miles", "kilometers", 1.609344),
    ("kilograms", "pounds", 2.204623),
    ("pounds", "kilograms", 0.453592),
    ("liters", "gallons", 0.264172),
    ("meters", "feet", 3.28084),
    ("feet", "meters", 0.3048),
    ("celsius", "fahrenheit", None),
]
PHRASES = {
    "Good morning": {
        "Spanish": "Buenos días",
        "French": "Bonjour",
        "German": "Guten Morgen",
        "Italian": "Buongiorno",
    },
    "Thank you very much": {
        "Spanish": "Muchas gracias",
        "French": "Merci beaucoup",
        "German": "Vielen Dank",
        "Italian": "Grazie mille",
    },
    "Where is the train station?": {
        "Spanish": "¿Dónde está la estación de tren?",
        "French": "Où est la gare ?",
        "German": "Wo ist der Bahnhof?",
        "Italian": "Dov'è la stazione?",
    },
    "How much does this cost?": {
        "Spanish": "¿Cuánto cuesta esto?",
        "French": "Combien ça coûte ?",
        "German": "Wie viel kostet das?",
        "Italian": "Quanto costa questo?",
    },
    "I would like a coffee": {
        "Spanish": "Quisiera un café",
        "French": "Je voudrais un café",
        "German": "Ich hätte gern einen Kaffee",
        "Italian": "Vorrei un caffè",
    },
}
MOVIES = {
    "Inception": (2010, "Christopher Nolan", 8.8),
    "The Matrix": (1999, "Lana Wachowski", 8.7),
    "Parasite": (2019, "Bong Joon-ho", 8.5),
    "Spirited Away": (2001, "Hayao Miyazaki", 8.6),
    "Jaws": (1975, "Steven Spielberg", 8.1),
    "Amelie": (2001, "Jean-Pierre Jeunet", 8.3),
    "Alien": (1979, "Ridley Scott", 8.5),
    "Arrival": (2016, "Denis Villeneuve", 7.9),
    "Casablanca": (1942, "Michael Curtiz", 8.5),
    "Heat": (1995, "Michael Mann", 8.3),
}
WORDS = {
    "serendipity": "the occurrence of events by chance in a happy way",
    "ephemeral": "lasting for a very short time",
    "ubiquitous": "present everywhere",
    "meticulous": "showing great attention to detail",
    "resilient": "able to recover quickly",
    "candid": "truthful and straightforward",
    "gregarious": "fond of company",
    "pragmatic": "dealing with things sensibly and realistically",
}
INGREDIENTS = [
    "chicken",
    "rice",
    "tomatoes",
    "garlic",
    "spinach",
    "eggs",
    "mushrooms",
    "beans",
    "tofu",
    "potatoes",
    "onions",
    "cheese",
    "pasta",
    "salmon",
    "lentils",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "partly cloudy", "clear"]
NEWS = ["technology", "sports", "business", "science", "health", "entertainment"]
COUNTRIES = ["the US", "the UK", "Canada", "Germany", "France", "Japan", "India", "Australia"]
CARRIERS = ["UPS", "FedEx", "DHL", "USPS"]


@dataclass(frozen=True)
class Tool:
    """One callable function: its schema, how users ask for it, its fake results and answers."""

    name: str
    description: str
    params: dict  # JSON-schema properties
    required: tuple
    asks: tuple  # user requests; every {param} used becomes an argument (all required ones appear)
    vague: tuple  # requests without the details
    sample: Callable  # rng -> {param: value, plus display-only slots starting with "_"}
    result: Callable  # (rng, args) -> dict for the tool message; answer slots too
    answers: tuple

    def schema(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {"type": "object", "properties": self.params, "required": list(self.required)},
        }


def s(desc, **extra):
    return {"type": "string", "description": desc, **extra}


def n(desc, kind="number"):
    return {"type": kind, "description": desc}


def _date(r):
    """An ISO date argument and how a user might say it."""
    y, m, d = 2025, r.randrange(1, 13), r.randrange(1, 29)
    iso = f"{y}-{m:02d}-{d:02d}"
    return {"date": iso, "_date": r.choice([f"{MONTHS[m - 1]} {d}", iso, f"{d} {MONTHS[m - 1]} {y}"])}


def _money(r, lo, hi):
    return round(r.uniform(lo, hi), r.choice([0, 2]))


def _convert(args):
    factor = next(k for a, b, k in UNITS if (a, b) == (args["from_unit"], args["to_unit"]))
    value = args["value"]
    return round(value * 9 / 5 + 32, 2) if factor is None else round(value * factor, 2)


def _weather(r, a):
    return {
        "location": a["location"],
        "temperature": r.randrange(-5, 35),
        "unit": a.get("unit", "celsius"),
        "condition": r.choice(CONDITIONS),
        "humidity": r.randrange(20, 95),
    }


def _flight(r, a):
    flight = {
        "airline": r.choice(["SkyJet", "AeroLine", "BlueWings", "NorthAir"]),
        "departure": f"{r.randrange(6, 22):02d}:{r.choice(['00', '15', '30', '45'])}",
        "price": r.randrange(80, 1200),
    }
    return {"origin": a["origin"], "destination": a["destination"], "flights": [flight]}


def _restaurant(r, a):
    name = (
        f"{r.choice(['The Golden', 'Little', 'Casa', 'Blue', 'Old Town'])} "
        f"{r.choice(['Spoon', 'Garden', 'Table', 'Kitchen', 'Lantern'])}"
    )
    return {"name": name, "rating": round(r.uniform(3.5, 5.0), 1), "address": f"{r.randrange(1, 300)} Main Street"}


def _email_args(r):
    who = r.choice(NAMES)
    return {
        "recipient": f"{who.lower()}@{r.choice(DOMAINS)}",
        "subject": r.choice(["Meeting notes", "Quick question", "Dinner plans", "Report"]),
        "body": r.choice(
            [
                "See you tomorrow at ten.",
                f"Thanks for your help, {who}!",
                "The report is attached.",
                "Can we move our call to Friday?",
            ]
        ),
    }


def _event_args(r):
    title = r.choice(
        [
            "Team meeting",
            "Dentist",
            "Project review",
            "Yoga class",
            f"Lunch with {r.choice(NAMES)}",
            f"Call with {r.choice(NAMES)}",
        ]
    )
    return {
        "title": title,
        "time": f"{r.randrange(7, 20):02d}:{r.choice(['00', '30'])}",
        "duration_minutes": r.choice([15, 30, 45, 60, 90]),
        **_date(r),
    }


def _recipe_args(r):
    chosen = r.sample(INGREDIENTS, r.randrange(1, 4))
    return {"ingredients": chosen, "_ingredients": " and ".join(chosen)}


def _recipe(r, a):
    dish = (
        f"{r.choice(['Easy', 'Quick', 'Homestyle', 'Spicy'])} {a['ingredients'][0]} "
        f"{r.choice(['stir-fry', 'bake', 'soup', 'salad'])}"
    )
    return {"recipe": dish, "minutes": r.choice([15, 20, 30, 45])}


def _headline(r, a):
    return {
        "headline": f"{r.choice(['New', 'Major', 'Surprising', 'Record'])} "
        f"{r.choice(['breakthrough', 'deal', 'result', 'report'])} in {a['category']}"
    }


def _password(r, a):
    alphabet = "abcdefghjkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"
    return {"password": "".join(r.choice(alphabet) for _ in range(a["length"]))}


def _company(r):
    company = r.choice(sorted(COMPANIES))
    return {"symbol": COMPANIES[company], "_company": company}


def _currencies(r):
    source, target = r.sample(sorted(CURRENCIES), 2)
    return {"amount": _money(r, 5, 5000), "from_currency": source, "to_currency": target}


def _converted(r, a):
    rate = CURRENCIES[a["to_currency"]] / CURRENCIES[a["from_currency"]]
    return {**a, "converted_amount": round(a["amount"] * rate, 2)}


def _unit_args(r):
    source, target, _ = r.choice(UNITS)
    return {"value": r.randrange(1, 500), "from_unit": source, "to_unit": target}


def _route(r, with_date=False):
    origin, destination = r.sample(CITIES, 2)
    extra = _date(r) if with_date else {"mode": r.choice(["driving", "flying"])}
    return {"origin": origin, "destination": destination, **extra}


TOOLS = [
    Tool(
        name="get_current_weather",
        description="Get the current weather in a city",
        params={"location": s("The city name"), "unit": s("Temperature unit", enum=["celsius", "fahrenheit"])},
        required=("location",),
        asks=(
            "What's the weather like in {location} right now?",
            "How warm is it in {location} today?",
            "Is it raining in {location}?",
            "Tell me the current weather in {location} in {unit}.",
            "Can you check the weather for {location}, in {unit} please?",
        ),
        vague=("What's the weather like right now?", "Can you check the weather for me?"),
        sample=lambda r: {"location": r.choice(CITIES), "unit": r.choice(["celsius", "fahrenheit"])},
        result=_weather,
        answers=(
            "It's currently {temperature} degrees {unit} and {condition} in {location}, with "
            "{humidity}% humidity.",
            "Right now {location} is {condition} at {temperature} degrees {unit}. Humidity is {humidity}%.",
        ),
    ),
    Tool(
        name="get_weather_forecast",
        description="Get the daily weather forecast for a city",
        params={"location": s("The city name"), "days": n("Number of days, 1 to 7", "integer")},
        required=("location", "days"),
        asks=(
            "What's the forecast for {location} for the next {days} days?",
            "Give me a {days}-day weather forecast for {location}.",
            "Will it rain in {location} in the next {days} days?",
        ),
        vague=("I need a weather forecast.",),
        sample=lambda r: {"location": r.choice(CITIES), "days": r.randrange(1, 8)},
        result=lambda r, a: {
            "location": a["location"],
            "days": a["days"],
            "high": r.randrange(5, 35),
            "low": r.randrange(-5, 15),
            "summary": r.choice(CONDITIONS),
        },
        answers=(
            "Over the next {days} days {location} will be mostly {summary}, with highs around {high} "
            "and lows near {low} degrees.",
            "The {days}-day forecast for {location}: mostly {summary}, {low} to {high} degrees.",
        ),
    ),
    Tool(
        name="convert_currency",
        description="Convert an amount from one currency to another",
        params={
            "amount": n("The amount to convert"),
            "from_currency": s("ISO code of the source currency"),
            "to_currency": s("ISO code of the target currency"),
        },
        required=("amount", "from_currency", "to_currency"),
        asks=(
            "How much is {amount} {from_currency} in {to_currency}?",
            "Convert {amount} {from_currency} to {to_currency}.",
            "I have {amount} {from_currency}. What is that in {to_currency}?",
        ),
        vague=("Can you help me convert some money?", "I need a currency conversion."),
        sample=_currencies,
        result=_converted,
        answers=(
            "{amount} {from_currency} is about {converted_amount} {to_currency}.",
            "That comes to {converted_amount} {to_currency} for {amount} {from_currency}.",
        ),
    ),
    Tool(
        name="get_stock_price",
        description="Get the latest stock price of a company by ticker symbol",
        params={"symbol": s("Stock ticker symbol, e.g. AAPL")},
        required=("symbol",),
        asks=(
            "What's the current stock price of {_company}?",
            "How is {_company} stock trading today?",
            "Give me the share price for {symbol}.",
            "What is {_company} trading at?",
        ),
        vague=("Can you look up a stock price for me?",),
        sample=_company,
        result=lambda r, a: {
            "symbol": a["symbol"],
            "price": round(r.uniform(20, 900), 2),
            "change_percent": round(r.uniform(-4, 4), 2),
        },
        answers=(
            "{symbol} is trading at ${price}, {change_percent}% on the day.",
            "The latest price for {symbol} is ${price} ({change_percent}% today).",
        ),
    ),
    Tool(
        name="search_flights",
        description="Search for flights between two cities on a date",
        params={"origin": s("Departure city"), "destination": s("Arrival city"), "date": s("Date, YYYY-MM-DD")},
        required=("origin", "destination", "date"),
        asks=(
            "Find me a flight from {origin} to {destination} on {_date}.",
            "Are there flights from {origin} to {destination} on {_date}?",
            "I need to fly {origin} to {destination} on {_date}.",
        ),
        vague=("I want to book a flight.", "Can you find flights for me?"),
        sample=lambda r: _route(r, with_date=True),
        result=_flight,
        answers=(
            "I found a {airline} flight from {origin} to {destination} departing at {departure} for ${price}.",
            "There's a {airline} flight at {departure} from {origin} to {destination}; it costs ${price}.",
        ),
    ),
    Tool(
        name="find_restaurants",
        description="Find restaurants in a city by cuisine",
        params={
            "location": s("City"),
            "cuisine": s("Type of food"),
            "price_range": s("Budget", enum=["cheap", "moderate", "expensive"]),
        },
        required=("location", "cuisine"),
        asks=(
            "Find me a {cuisine} restaurant in {location}.",
            "Any good {cuisine} places in {location}?",
            "I'm in {location} and want {price_range} {cuisine} food.",
            "Recommend a {price_range} {cuisine} restaurant in {location}.",
        ),
        vague=("I'm hungry, can you find a restaurant?",),
        sample=lambda r: {
            "location": r.choice(CITIES),
            "cuisine": r.choice(CUISINES),
            "price_range": r.choice(["cheap", "moderate", "expensive"]),
        },
        result=_restaurant,
        answers=(
            "Try {name} at {address}; it's rated {rating} out of 5.",
            "{name} ({address}) is a great choice, with a {rating} rating.",
        ),
    ),
    Tool(
        name="create_calendar_event",
        description="Create an event in the user's calendar",
        params={
            "title": s("Event title"),
            "date": s("Date, YYYY-MM-DD"),
            "time": s("Start time, HH:MM"),
            "duration_minutes": n("Duration in minutes", "integer"),
        },
        required=("title", "date", "time"),
        asks=(
            "Schedule '{title}' on {_date} at {time}.",
            "Add {title} to my calendar for {_date} at {time}, {duration_minutes} minutes.",
            "Put a {duration_minutes}-minute '{title}' on {_date} at {time}.",
        ),
        vague=("Can you add something to my calendar?",),
        sample=_event_args,
        result=lambda r, a: {"status": "created", "event_id": f"evt_{r.randrange(10000, 99999)}", **a},
        answers=(
            "Done! '{title}' is on your calendar for {date} at {time}.",
            "I've scheduled '{title}' on {date} at {time}.",
        ),
    ),
    Tool(
        name="send_email",
        description="Send an email",
        params={"recipient": s("Email address"), "subject": s("Subject line"), "body": s("Message text")},
        required=("recipient", "subject", "body"),
        asks=(
            "Email {recipient} with the subject '{subject}' saying: {body}",
            "Send an email to {recipient}. Subject: {subject}. Message: {body}",
        ),
        vague=("I need to send an email.", "Can you write an email for me?"),
        sample=_email_args,
        result=lambda r, a: {"status": "sent", "recipient": a["recipient"]},
        answers=("Your email to {recipient} has been sent.", "Sent! {recipient} should have it shortly."),
    ),
    Tool(
        name="convert_units",
        description="Convert a value between units",
        params={
            "value": n("The value"),
            "from_unit": s("Unit to convert from"),
            "to_unit": s("Unit to convert to"),
        },
        required=("value", "from_unit", "to_unit"),
        asks=(
            "How many {to_unit} is {value} {from_unit}?",
            "Convert {value} {from_unit} to {to_unit}.",
            "What's {value} {from_unit} in {to_unit}?",
        ),
        vague=("Can you convert a measurement for me?",),
        sample=_unit_args,
        result=lambda r, a: {**a, "result": _convert(a)},
        answers=("{value} {from_unit} is {result} {to_unit}.", "That's {result} {to_unit}."),
    ),
    Tool(
        name="calculate_bmi",
        description="Calculate body mass index",
        params={"weight_kg": n("Weight in kilograms"), "height_cm": n("Height in centimeters")},
        required=("weight_kg", "height_cm"),
        asks=(
            "I weigh {weight_kg} kg and I'm {height_cm} cm tall. What's my BMI?",
            "Calculate my BMI: {weight_kg} kg, {height_cm} cm.",
        ),
        vague=("Can you calculate my BMI?",),
        sample=lambda r: {"weight_kg": r.randrange(45, 120), "height_cm": r.randrange(150, 200)},
        result=lambda r, a: {"bmi": round(a["weight_kg"] / (a["height_cm"] / 100) ** 2, 1)},
        answers=("Your BMI is {bmi}.", "With those numbers your body mass index is {bmi}."),
    ),
    Tool(
        name="calculate_loan_payment",
        description="Calculate the monthly payment of a loan",
        params={
            "principal": n("Loan amount"),
            "annual_rate": n("Annual interest rate in percent"),
            "years": n("Loan term in years", "integer"),
        },
        required=("principal", "annual_rate", "years"),
        asks=(
            "What would my monthly payment be on a {principal} loan at {annual_rate}% for {years} years?",
            "Calculate the payment for borrowing {principal} over {years} years at {annual_rate} percent.",
        ),
        vague=("I need help with a loan calculation.",),
        sample=lambda r: {
            "principal": r.randrange(5, 500) * 1000,
            "annual_rate": round(r.uniform(2, 9), 1),
            "years": r.choice([5, 10, 15, 20, 30]),
        },
        result=lambda r, a: {"monthly_payment": _payment(a)},
        answers=(
            "Your monthly payment would be about ${monthly_payment}.",
            "That works out to ${monthly_payment} per month.",
        ),
    ),
    Tool(
        name="calculate_tip",
        description="Calculate the tip for a bill",
        params={"bill_amount": n("Total bill"), "tip_percentage": n("Tip percentage", "integer")},
        required=("bill_amount", "tip_percentage"),
        asks=(
            "What's a {tip_percentage}% tip on a ${bill_amount} bill?",
            "My bill is ${bill_amount}. How much is a {tip_percentage} percent tip?",
        ),
        vague=("Can you help me figure out the tip?",),
        sample=lambda r: {"bill_amount": _money(r, 10, 300), "tip_percentage": r.choice([10, 12, 15, 18, 20, 25])},
        result=lambda r, a: {"tip_amount": round(a["bill_amount"] * a["tip_percentage"] / 100, 2)},
        answers=("A {tip_percentage}% tip would be ${tip_amount}.", "You should leave ${tip_amount}."),
    ),
    Tool(
        name="translate_text",
        description="Translate text into another language",
        params={"text": s("Text to translate"), "target_language": s("Language to translate into")},
        required=("text", "target_language"),
        asks=(
            "How do you say '{text}' in {target_language}?",
            "Translate '{text}' into {target_language}.",
            "What is '{text}' in {target_language}?",
        ),
        vague=("Can you translate something for me?",),
        sample=lambda r: {
            "text": r.choice(sorted(PHRASES)),
            "target_language": r.choice(["Spanish", "French", "German", "Italian"]),
        },
        result=lambda r, a: {"translation": PHRASES[a["text"]][a["target_language"]]},
        answers=(
            'In {target_language}, that\'s "{translation}".',
            '"{translation}" is how you say it in {target_language}.',
        ),
    ),
    Tool(
        name="get_movie_details",
        description="Get details about a movie",
        params={"title": s("Movie title")},
        required=("title",),
        asks=("Tell me about the movie {title}.", "Who directed {title}?", "When did {title} come out?"),
        vague=("Can you look up a movie for me?",),
        sample=lambda r: {"title": r.choice(sorted(MOVIES))},
        result=lambda r, a: dict(zip(("year", "director", "rating"), MOVIES[a["title"]]), title=a["title"]),
        answers=(
            "{title} was released in {year}, directed by {director}, and is rated {rating}/10.",
            "{director} directed {title} ({year}); it is rated {rating}/10.",
        ),
    ),
    Tool(
        name="get_news_headlines",
        description="Get the latest news headlines",
        params={"category": s("News category"), "country": s("Country")},
        required=("category",),
        asks=(
            "What are the latest {category} headlines?",
            "Any {category} news from {country} today?",
            "Show me top {category} stories in {country}.",
        ),
        vague=("What's in the news?",),
        sample=lambda r: {"category": r.choice(NEWS), "country": r.choice(COUNTRIES)},
        result=_headline,
        answers=(
            'Top {category} headline: "{headline}".',
            'The biggest {category} story right now is "{headline}".',
        ),
    ),
    Tool(
        name="get_local_time",
        description="Get the current local time in a city",
        params={"city": s("City name")},
        required=("city",),
        asks=("What time is it in {city}?", "What's the local time in {city} right now?"),
        vague=("What time is it over there?",),
        sample=lambda r: {"city": r.choice(CITIES)},
        result=lambda r, a: {
            "city": a["city"],
            "local_time": f"{r.randrange(0, 24):02d}:{r.randrange(0, 60):02d}",
        },
        answers=("It's {local_time} in {city}.", "The local time in {city} is {local_time}."),
    ),
    Tool(
        name="track_package",
        description="Track a package by tracking number",
        params={"tracking_number": s("Tracking number"), "carrier": s("Shipping carrier")},
        required=("tracking_number",),
        asks=(
            "Where is my package {tracking_number}?",
            "Track {carrier} package {tracking_number}.",
            "Can you check the status of {tracking_number} with {carrier}?",
        ),
        vague=("Where is my package?",),
        sample=lambda r: {
            "tracking_number": f"{r.choice('ABCXYZ')}{r.randrange(10**8, 10**9)}",
            "carrier": r.choice(CARRIERS),
        },
        result=lambda r, a: {
            "status": r.choice(["in transit", "out for delivery", "delivered"]),
            "location": r.choice(CITIES),
            **a,
        },
        answers=(
            "Package {tracking_number} is {status}; last scanned in {location}.",
            "Your package ({tracking_number}) is {status}, last seen in {location}.",
        ),
    ),
    Tool(
        name="search_recipes",
        description="Search recipes by ingredients",
        params={
            "ingredients": {"type": "array", "items": {"type": "string"}, "description": "Ingredients to use"}
        },
        required=("ingredients",),
        asks=("What can I cook with {_ingredients}?", "Find me a recipe using {_ingredients}."),
        vague=("Can you suggest a recipe?",),
        sample=_recipe_args,
        result=_recipe,
        answers=(
            "How about a {recipe}? It takes about {minutes} minutes.",
            "You could make a {recipe} in {minutes} minutes.",
        ),
    ),
    Tool(
        name="set_reminder",
        description="Set a reminder",
        params={"message": s("What to be reminded of"), "time": s("Time, HH:MM")},
        required=("message", "time"),
        asks=("Remind me to {message} at {time}.", "Set a reminder at {time} to {message}."),
        vague=("Can you set a reminder for me?",),
        sample=lambda r: {
            "message": r.choice(
                [
                    "call mom",
                    "take my medicine",
                    "water the plants",
                    "pick up the kids",
                    "submit the report",
                    "buy groceries",
                ]
            ),
            "time": f"{r.randrange(6, 23):02d}:{r.choice(['00', '15', '30', '45'])}",
        },
        result=lambda r, a: {"status": "set", **a},
        answers=("Okay, I'll remind you to {message} at {time}.", "Reminder set for {time}: {message}."),
    ),
    Tool(
        name="calculate_distance",
        description="Calculate the travel distance between two cities",
        params={
            "origin": s("Start city"),
            "destination": s("End city"),
            "mode": s("Travel mode", enum=["driving", "flying"]),
        },
        required=("origin", "destination"),
        asks=(
            "How far is {origin} from {destination}?",
            "What's the {mode} distance between {origin} and {destination}?",
        ),
        vague=("How far apart are two cities?",),
        sample=_route,
        result=lambda r, a: {"distance_km": r.randrange(100, 15000), **a},
        answers=(
            "{origin} and {destination} are about {distance_km} km apart.",
            "The distance is roughly {distance_km} km.",
        ),
    ),
    Tool(
        name="generate_password",
        description="Generate a random password",
        params={
            "length": n("Password length", "integer"),
            "include_symbols": {"type": "boolean", "description": "Use symbols"},
        },
        required=("length",),
        asks=("Generate a {length}-character password.", "I need a new password, {length} characters long."),
        vague=("Can you make me a password?",),
        sample=lambda r: {"length": r.choice([8, 10, 12, 16, 20, 24])},
        result=_password,
        answers=("Here is your password: {password}", "Your new password is {password}"),
    ),
    Tool(
        name="get_word_definition",
        description="Get the definition of an English word",
        params={"word": s("The word")},
        required=("word",),
        asks=("What does '{word}' mean?", "Define {word}.", "What's the meaning of the word {word}?"),
        vague=("Can you define a word for me?",),
        sample=lambda r: {"word": r.choice(sorted(WORDS))},
        result=lambda r, a: {"word": a["word"], "definition": WORDS[a["word"]]},
        answers=("'{word}' means {definition}.", "{word}: {definition}."),
    ),
]
SYSTEM_PROMPTS = (
    "You are a helpful assistant with access to the following functions. Use them if required.",
    "You are a function-calling assistant. You may call one of these tools when it helps the user.",
    "You are a helpful assistant. These functions are available to you:",
)
CALL_NOTE = 'To call a function, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
GREETINGS = ("", "", "Hi! ", "Hello, ", "Hey, ", "Good morning. ", "Quick question: ")
THANKS = ("", "", " Thanks!", " Thank you.", " Please.")
FOLLOW_UPS = ("Thanks! Also, ", "Great. Next: ", "Perfect. One more thing: ", "Thank you. ")


def _payment(a) -> float:
    rate, months = a["annual_rate"] / 1200, a["years"] * 12
    return round(a["principal"] * rate / (1 - (1 + rate) ** -months), 2)


# Arguments a user states through a display form: "Apple" for AAPL, "March 5" for 2025-03-05.
DISPLAY = {"symbol": "_company", "ingredients": "_ingredients", "date": "_date"}


def mentions(template: str, param: str) -> bool:
    """Whether a request template states `param` (directly or in its display form)."""
    return "{" + param + "}" in template or (param in DISPLAY and "{" + DISPLAY[param] + "}" in template)


def _ask(r: random.Random, tool: Tool, values: dict, openers=GREETINGS) -> tuple[str, dict]:
    """A user request and the arguments it states (exactly the params its template mentions)."""
    template = r.choice(tool.asks)
    args = {k: values[k] for k in tool.params if mentions(template, k)}
    greeting, text = r.choice(openers), template.format(**values)
    if greeting.endswith(", ") and not template.startswith("{"):
        text = text[0].lower() + text[1:]
    return greeting + text + r.choice(THANKS), args


def _call(tool: Tool, args: dict) -> str:
    call = json.dumps({"name": tool.name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _exchange(r: random.Random, tool: Tool, args: dict, values: dict) -> list[dict]:
    """Assistant call, tool result, assistant answer."""
    result = tool.result(r, args)
    flat = {**values, **args, **result}
    if isinstance(result.get("flights"), list):
        flat.update(result["flights"][0])
    return [
        {"role": "assistant", "content": _call(tool, args)},
        {"role": "tool", "content": json.dumps(result, ensure_ascii=False)},
        {"role": "assistant", "content": r.choice(tool.answers).format(**flat)},
    ]


def _system(r: random.Random, tools: list[Tool]) -> dict:
    specs = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)
    return {"role": "system", "content": f"{r.choice(SYSTEM_PROMPTS)}\n<tools>\n{specs}\n</tools>\n{CALL_NOTE}"}


def make_example(r: random.Random) -> list[dict]:
    """One chat: a single call (55%), clarify-then-call (15%), two calls (15%) or no fitting tool (15%)."""
    kind = r.choices(["single", "clarify", "two", "none"], weights=[55, 15, 15, 15])[0]
    tool = r.choice(TOOLS)
    others = [t for t in TOOLS if t is not tool]
    values = tool.sample(r)
    if kind == "none":
        offered = r.sample(others, r.randrange(1, 3))
        ask, _ = _ask(r, tool, values)
        can = " or ".join(t.description[0].lower() + t.description[1:] for t in offered)
        reply = r.choice(
            (
                "I'm sorry, but I can't help with that. The functions I have can only {can}.",
                "Unfortunately I don't have a tool for that. I can {can}, if that helps.",
            )
        )
        return [
            _system(r, offered),
            {"role": "user", "content": ask},
            {"role": "assistant", "content": reply.format(can=can)},
        ]
    if kind == "two":
        second = r.choice(others)
        tools = [tool, second] if r.random() < 0.5 else [second, tool]
        ask, args = _ask(r, tool, values)
        values2 = second.sample(r)
        ask2, args2 = _ask(r, second, values2, FOLLOW_UPS)
        return [
            _system(r, tools),
            {"role": "user", "content": ask},
            *_exchange(r, tool, args, values),
            {"role": "user", "content": ask2},
            *_exchange(r, second, args2, values2),
        ]
    tools = [tool, *r.sample(others, r.choice([0, 0, 1, 1, 2]))]
    r.shuffle(tools)
    messages = [_system(r, tools)]
    if kind == "clarify":
        wants = " and ".join(tool.params[k]["description"].lower().removeprefix("the ") for k in tool.required)
        reply = ", ".join(f"{k.replace('_', ' ')}: {values.get(DISPLAY.get(k), values[k])}" for k in tool.required)
        messages += [
            {"role": "user", "content": r.choice(tool.vague)},
            {"role": "assistant", "content": f"Sure, I can help with that. Could you tell me the {wants}?"},
            {"role": "user", "content": reply[0].upper() + reply[1:] + "."},
        ]
        return messages + _exchange(r, tool, {k: values[k] for k in tool.required}, values)
    ask, args = _ask(r, tool, values)
    return messages + [{"role": "user", "content": ask}] + _exchange(r, tool, args, values)


def generate(num_examples: int, seed: int):
    """Records {"messages": [...]}, a pure function of (num_examples, seed)."""
    r = random.Random(seed)
    for _ in range(num_examples):
        yield {"messages": make_example(r)}


def generator_main(argv, description: str, generate, noun: str) -> int:
    """The generators' command line: --num-examples records of `generate(num_examples, seed)` as JSONL to
    --output (its directory made if missing; '-' for stdout)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--num-examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="JSONL file to write ('-' for stdout)")
    args = parser.parse_args(argv)
    if args.num_examples < 1:
        parser.error(f"--num-examples={args.num_examples} must be >= 1")
    lines = (json.dumps(r, ensure_ascii=False) + "\n" for r in generate(args.num_examples, args.seed))
    if args.output == "-":
        sys.stdout.writelines(lines)
    else:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(lines)
        print(f"wrote {args.num_examples} {noun} to {args.output}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return generator_main(argv, __doc__.splitlines()[0], generate, "chats")


if __name__ == "__main__":
    sys.exit(main())
